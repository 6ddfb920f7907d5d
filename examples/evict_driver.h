/* evict_driver.h - budgeted eviction (kvmix.h, "Budgeted eviction") run by a decode loop: which
 * positions of a token stream are requests' prompts, what each step records, and the eviction
 * once a request's prompt ran. The driver knows no runner: a backend (evict_backend) records,
 * scores and evicts for it, over gpu_llama (evict_backend_gpu, the GPU loop) or over the CPU
 * runner's kvmix-backed cache (evict_backend_cpu, llama.h with kvmix_kv.h), so that both evict
 * the same positions of the same texts.
 *
 * A request is a user turn; its actionable span is the user message, as the template tagger
 * (kvmix_tagger) finds it: the turn's tokens tagged KVMIX_ROLE_USER, [first, end). The eviction
 * of a request runs before position `end` runs, when the whole prompt has run (its queries and
 * attention are recorded): the scorer gives every position a score, the protected prefix and the
 * actionable span are forced, and the lowest-scoring others beyond the budget are evicted.
 * Scorers: INTENT blends the span's mean query into the session's QueryMemory (a
 * kvmix_session_store keyed by the first request's span) and scores with it; QUERY scores with the
 * span's mean query alone; STREAMING by recency; H2O by the attention every query gave so far,
 * the most recent kept; SNAPKV by the attention of the prompt's last observe_tokens queries,
 * max-pooled.
 *
 * Errors: llama_result with a one-line message in (err, err_bytes); nothing prints or exits.
 */
#ifndef EVICT_DRIVER_H
#define EVICT_DRIVER_H

#include "kvmix.h"
#include "llama.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct evict_request {
    int32_t first, end; /* the user message: positions [first, end) */
} evict_request;

/* The requests of a token stream, in order: *out_n of at most max_requests. A turn whose user
 * message is cut off by the stream's end has none. LLAMA_ERR_ARGUMENT: a spec that does not
 * check. */
llama_result evict_plan(const kvmix_tag_spec *spec, const int32_t *ids, int64_t n_ids,
                        evict_request *out, int32_t max_requests, int32_t *out_n, char *err,
                        size_t err_bytes);

/* What one run's evictions did, summed over its sequences. */
typedef struct evict_stats {
    int64_t n_evictions;    /* requests whose history exceeded the budget */
    int64_t evicted_tokens; /* positions evicted */
    int64_t live_peak_sum;  /* per sequence the most live positions it had, summed */
    int64_t n_seqs;         /* sequences that ended */
    double bytes_freed;     /* cache bytes the sequences held less right after their evictions */
} evict_stats;

/* Per sequence: where it is in its requests, its recorded attention (H2O) by position. */
typedef struct evict_seq {
    const int32_t *ids;
    const evict_request *requests;
    int32_t n_requests, next; /* the next request to evict at */
    int32_t live_peak;
    float *mass; /* H2O: [max_tokens] attention so far */
    int64_t id;  /* the caller's (its text), for logs: set it after evict_seq_start */
    /* evict_driver_rows: per request its rule scores, the attention its prompt gave each
       position, the positions' key norms and readouts (request i's positions at rows[row_at[i]
       + k * requests[i].end], k = 0 .. 3 in that order); allocated by evict_seq_start, freed by
       evict_seq_end or evict_seq_release */
    float *rows;
    int64_t *row_at;
    int rows_failed; /* the allocation failed: evict_before_step says so */
} evict_seq;

/* What a runner does for the driver, on one of its sequences (runner, seq). Each function
 * returns LLAMA_OK or an error with its message in (err, err_bytes). */
enum { EVICT_OBSERVE_QUERIES = 1, EVICT_OBSERVE_ATTENTION = 2 };
typedef struct evict_backend {
    void *runner;
    int32_t seq;
    /* What the next steps record, until changed: EVICT_OBSERVE_QUERIES sums the post-RoPE
       queries (every layer and q head), EVICT_OBSERVE_ATTENTION adds the attention the queries
       give each position (per q head a softmax over the live positions, summed over heads and
       layers); 0 nothing. */
    llama_result (*observe)(void *runner, int32_t seq, int32_t flags, char *err, size_t err_bytes);
    /* Takes and clears what was recorded: query_sum [n_layers][n_heads][head_dim] and the steps
       summed, attention [positions the sequence has] (either NULL: left recorded). */
    llama_result (*observed_take)(void *runner, int32_t seq, float *query_sum,
                                  int32_t *out_n_queries, float *attention, char *err,
                                  size_t err_bytes);
    /* Per position the softmax per q head of memory . key over the live positions, summed over
       heads and layers; memory [n_layers][n_heads][head_dim]; -INFINITY for evicted positions. */
    llama_result (*intent_scores)(void *runner, int32_t seq, const float *memory, float *scores,
                                  char *err, size_t err_bytes);
    /* The kvmix cache and its sequence (for kvmix_cache_locate). */
    const kvmix_cache *(*inner)(const void *runner, int32_t seq, int32_t *out_kv_seq);
    /* kvmix_cache_evict of the positions, then kvmix_cache_compact. */
    llama_result (*evict)(void *runner, int32_t seq, const int32_t *positions, int32_t n_positions,
                          char *err, size_t err_bytes);
    void (*seq_stats)(const void *runner, int32_t seq, llama_kv_stats *out);
    /* The intent residual's key features of every position for the memory intent_scores took
       (kvmix.h's KEY_NORM and READOUT: kvmix_ref_view_key_features averaged over layers;
       key_norm, readout [positions the sequence has], 0 for evicted ones); NULL where the
       runner has none: the features are 0. */
    llama_result (*key_features)(void *runner, int32_t seq, const float *memory, float *key_norm,
                                 float *readout, char *err, size_t err_bytes);
} evict_backend;

/* The backend over gpu_llama's sequence seq (evict_gpu.c, the GPU build's). */
struct gpu_llama;
evict_backend evict_backend_gpu(struct gpu_llama *g, int32_t seq);
/* The backend over the CPU runner: a kvmix-backed llama_kv_cache (kvmix_kv_create) whose
 * sequence llama_forward runs (kvmix_kv_observe and the calls beside it). */
evict_backend evict_backend_cpu(llama_kv_cache *cache);

typedef struct evict_driver evict_driver;

/* A driver for `policy` (resolved here) on a model of this config, up to max_seqs sequences at
 * once of up to max_tokens positions; its session store (INTENT) holds max_seqs sessions, least
 * recently used first out (a loop that runs one sequence at a time may pass more, to keep the
 * sessions a batched loop would). LLAMA_ERR_ARGUMENT: a policy that does not resolve. */
llama_result evict_driver_create(const kvmix_evict_policy *policy, const llama_config *config,
                                 int32_t max_seqs, int32_t max_tokens, evict_driver **out,
                                 char *err, size_t err_bytes);
void evict_driver_free(evict_driver *d);

/* A sequence starts over these ids and requests (kept by reference). */
void evict_seq_start(evict_driver *d, evict_seq *s, const int32_t *ids,
                     const evict_request *requests, int32_t n_requests);
/* Before the sequence's token at position pos runs on the backend's sequence: the eviction when
 * a request's prompt has just run, then what the step records. */
llama_result evict_before_step(evict_driver *d, evict_seq *s, const evict_backend *b, int32_t pos,
                               char *err, size_t err_bytes);
/* The sequence ends (its peak goes into the stats, its rows to the rows callback). */
void evict_seq_end(evict_driver *d, evict_seq *s, const evict_backend *b);
/* What evict_seq_start allocated, freed without ending (a run that stopped on an error); a
 * zeroed or ended state: nothing. */
void evict_seq_release(evict_seq *s);
void evict_driver_stats(const evict_driver *d, evict_stats *out);

/* IntentKV's second phase on the INTENT and QUERY scorers: each request's raw scores (the rule)
 * rescored by the residual w (kvmix_intent_residual_scores over kvmix_intent_residual_features,
 * the positions' tags from spec, KEY_NORM and READOUT from the backend's key_features, 0 where
 * it has none) before
 * the policy shapes them. w and spec are kept by reference (the residual and the rows tag with
 * the spec given last); w NULL: the rule alone (the default). LLAMA_ERR_ARGUMENT: weights that do
 * not check, a spec that does not, another scorer. */
llama_result evict_driver_residual(evict_driver *d, const kvmix_intent_residual *w,
                                   const kvmix_tag_spec *spec, char *err, size_t err_bytes);

/* Training rows for the residual, INTENT and QUERY scorers: the features of positions [0, end)
 * at each request (kvmix_intent_residual_features: the rule as the request scored it, before any
 * residual; tags from spec; KEY_NORM and READOUT as the residual gets them) and as target the
 * attention the later
 * requests' prompts gave each position (per q head a softmax over the live positions, summed
 * over q heads, layers and those prompts' positions: each later prompt token adds at most
 * n_layers * n_heads, summed in double). The policy must evict nothing (budget_fraction 1): a
 * position evicted would get no later attention because it was evicted. When a sequence ends,
 * rows(user, s, request, features [n][F], target [n], n) runs for each of its requests that a
 * later one followed, newest first. Call before sequences start; spec is kept by reference; rows
 * NULL: none (the default). Recording the later prompts' attention costs what SnapKV's does, at
 * every prompt token. LLAMA_ERR_ARGUMENT: another scorer, a budget under 1, a spec that does not
 * check. */
typedef void (*evict_rows_fn)(void *user, const evict_seq *s, int32_t request,
                              const float *features, const float *target, int32_t n_positions);
llama_result evict_driver_rows(evict_driver *d, evict_rows_fn rows, void *user,
                               const kvmix_tag_spec *spec, char *err, size_t err_bytes);

/* Each eviction's positions, for a log (one runner's evictions against another's): log(user, s,
 * request index, positions, n), ascending, after they are evicted. NULL: none (the default). */
typedef void (*evict_log_fn)(void *user, const evict_seq *s, int32_t request,
                             const int32_t *positions, int32_t n_positions);
void evict_driver_log(evict_driver *d, evict_log_fn log, void *user);

#ifdef __cplusplus
}
#endif

#endif /* EVICT_DRIVER_H */

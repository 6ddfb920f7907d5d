/* pd_transfer: a prefill process hands its KV cache to a decode process over UCX.
 *
 *   pd_transfer --model M.safetensors --data D.jsonl [--text K] [--prompt-tokens N]
 *               [--generate N] [--budget B] [--inject truncate|corrupt|mismatch]
 *               [--min-agreement A] [--threads N]
 *
 * The program forks: the child is the decode worker, listening on a loopback UCX socket address;
 * the parent is the prefill worker, which connects to it. UCP tagged messages carry everything,
 * so the same program runs over whatever UCX picks (shared memory, TCP; RDMA between machines),
 * as UCX_TLS and UCX_NET_DEVICES say.
 *
 * Prefill: runs the model (llama.h, CPU) over the first N tokens of text K of the data file with
 * an fp16 kvmix cache, reads the rows back, gives each token a tier at budget B (transfer_plan.h:
 * the key/value-norm statistic, as this runner records no attention; recency decay 0.005; 4
 * sinks) and streams one transfer payload per layer (kvmix_payload_pack), waiting for each one's
 * status. Decode: checks each payload (header, tier table, shape, the layer it expects) and
 * ingests it into its own fp16 kvmix cache (kvmix_kv_ingest), then generates greedily from the
 * prefill's first token; before it starts it asks for the INT4 tokens of its sealed pages, and
 * the prefill sends their residuals (RESIDUAL payloads, INT8) while it decodes; the decode side
 * adds them to its pages (kvmix_kv_upgrade) as they arrive. Meanwhile the prefill generates the
 * same number of tokens on its own cache (the untransferred run). Both exchange their tokens and
 * print bytes sent, time, bandwidth and the agreement.
 *
 * --inject sends layer 0 once broken first (cut short, an invalid tier in its table, or the
 * layer above's payload in its place): the decode side must refuse it through the same path,
 * its cache unchanged, before the good one arrives. The run is bounded (every wait gives up
 * after WAIT_SECONDS, 300 s, or at once when the peer is gone) and exits 0 only when every
 * payload was handled as it should be and the agreement is at least --min-agreement (default
 * 0.9).
 */
#define _POSIX_C_SOURCE 200809L
#include "kvmix_kv.h"
#include "llama.h"
#include "transfer_plan.h"

#include <arpa/inet.h>
#include <cjson/cJSON.h>
#include <netinet/in.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <ucp/api/ucp.h>
#include <unistd.h>

enum { TAG_REQUEST = 1, TAG_LAYER, TAG_STATUS, TAG_ASK, TAG_RESIDUAL, TAG_TOKENS };
enum { INJECT_NONE, INJECT_TRUNCATE, INJECT_CORRUPT, INJECT_MISMATCH };
enum { N_SINKS = 4 };
#define TAG_MASK     0xffffffff00000000ull
#define WAIT_SECONDS 300.0 /* a sanitized build on a loaded machine prefills slowly */
#define LAMBDA       0.005
#define MAGIC        0x44504d56u /* "VMPD" */

typedef struct options {
    const char *model, *data;
    int64_t text, prompt_tokens, generate;
    double budget, min_agreement;
    int inject, threads;
} options;

/* The decode worker's first message: the request the prefill ran. */
typedef struct request_msg {
    uint32_t magic, version;
    int32_t n_layers, n_kv_heads, head_dim, n_prompt, first_token, n_generate;
} request_msg;

enum { NOT_THIS_REQUEST = 1 }; /* a status: a payload whose shape or layer is not the expected */

typedef struct status_msg {
    int32_t layer, result; /* 0 ingested; a kvmix_result; or NOT_THIS_REQUEST */
} status_msg;

/* What a status says, for the log. */
static const char *status_text(int32_t result) {
    return result == NOT_THIS_REQUEST ? "a payload of another layer or shape"
                                      : kvmix_result_string(result);
}

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

/* ---- the UCP link ---------------------------------------------------------------------------- */

typedef struct ucx_link {
    const char *who;
    ucp_context_h context;
    ucp_worker_h worker;
    ucp_listener_h listener;
    ucp_conn_request_h pending;
    ucp_ep_h ep;
    volatile bool peer_gone; /* the endpoint failed: the peer closed or died */
} ucx_link;

static bool link_init(ucx_link *k, const char *who) {
    ucp_config_t *config;
    ucp_params_t params = {.field_mask = UCP_PARAM_FIELD_FEATURES, .features = UCP_FEATURE_TAG};
    ucp_worker_params_t wp = {.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE,
                              .thread_mode = UCS_THREAD_MODE_SINGLE};
    memset(k, 0, sizeof *k);
    k->who = who;
    if (ucp_config_read(NULL, NULL, &config) != UCS_OK) return false;
    ucs_status_t s = ucp_init(&params, config, &k->context);
    ucp_config_release(config);
    if (s != UCS_OK) return false;
    return ucp_worker_create(k->context, &wp, &k->worker) == UCS_OK;
}

static void on_connection(ucp_conn_request_h request, void *arg) {
    ucx_link *k = arg;
    if (k->pending == NULL)
        k->pending = request;
    else
        ucp_listener_reject(k->listener, request);
}

static struct sockaddr_in loopback(uint16_t port) {
    struct sockaddr_in a;
    memset(&a, 0, sizeof a);
    a.sin_family = AF_INET;
    a.sin_port = htons(port);
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    return a;
}

/* Listens on a free loopback port, *out_port. */
static bool link_listen(ucx_link *k, uint16_t *out_port) {
    struct sockaddr_in a = loopback(0);
    ucp_listener_params_t lp = {
        .field_mask = UCP_LISTENER_PARAM_FIELD_SOCK_ADDR | UCP_LISTENER_PARAM_FIELD_CONN_HANDLER,
        .sockaddr = {.addr = (const struct sockaddr *)&a, .addrlen = sizeof a},
        .conn_handler = {.cb = on_connection, .arg = k}};
    ucp_listener_attr_t attr = {.field_mask = UCP_LISTENER_ATTR_FIELD_SOCKADDR};
    if (ucp_listener_create(k->worker, &lp, &k->listener) != UCS_OK) return false;
    if (ucp_listener_query(k->listener, &attr) != UCS_OK) return false;
    *out_port = ntohs(((const struct sockaddr_in *)&attr.sockaddr)->sin_port);
    return true;
}

/* A peer that goes away ends the waits for its messages. */
static void on_peer_error(void *arg, ucp_ep_h ep, ucs_status_t status) {
    (void)ep, (void)status;
    ((ucx_link *)arg)->peer_gone = true;
}

static bool link_accept(ucx_link *k) {
    for (double end = now() + WAIT_SECONDS; k->pending == NULL && now() < end;)
        ucp_worker_progress(k->worker);
    if (k->pending == NULL) return false;
    ucp_ep_params_t ep = {.field_mask = UCP_EP_PARAM_FIELD_CONN_REQUEST |
                                        UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE |
                                        UCP_EP_PARAM_FIELD_ERR_HANDLER,
                          .conn_request = k->pending,
                          .err_mode = UCP_ERR_HANDLING_MODE_PEER,
                          .err_handler = {.cb = on_peer_error, .arg = k}};
    return ucp_ep_create(k->worker, &ep, &k->ep) == UCS_OK;
}

static bool link_connect(ucx_link *k, uint16_t port) {
    struct sockaddr_in a = loopback(port);
    ucp_ep_params_t ep = {.field_mask = UCP_EP_PARAM_FIELD_FLAGS | UCP_EP_PARAM_FIELD_SOCK_ADDR |
                                        UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE |
                                        UCP_EP_PARAM_FIELD_ERR_HANDLER,
                          .flags = UCP_EP_PARAMS_FLAGS_CLIENT_SERVER,
                          .sockaddr = {.addr = (const struct sockaddr *)&a, .addrlen = sizeof a},
                          .err_mode = UCP_ERR_HANDLING_MODE_PEER,
                          .err_handler = {.cb = on_peer_error, .arg = k}};
    return ucp_ep_create(k->worker, &ep, &k->ep) == UCS_OK;
}

/* Progresses the worker until the request completes or the deadline passes. */
static bool link_wait(ucx_link *k, ucs_status_ptr_t request) {
    if (request == NULL) return true;
    if (UCS_PTR_IS_ERR(request)) return false;
    ucs_status_t s = UCS_INPROGRESS;
    for (double end = now() + WAIT_SECONDS; now() < end;) {
        ucp_worker_progress(k->worker);
        if ((s = ucp_request_check_status(request)) != UCS_INPROGRESS) break;
    }
    if (s == UCS_INPROGRESS) ucp_request_cancel(k->worker, request);
    ucp_request_free(request);
    return s == UCS_OK;
}

static bool link_send(ucx_link *k, int kind, const void *buf, size_t bytes) {
    ucp_request_param_t p = {.op_attr_mask = 0};
    return link_wait(k, ucp_tag_send_nbx(k->ep, buf, bytes, (uint64_t)kind << 32, &p));
}

/* A message of this kind if one has arrived (malloc'd, *out_bytes), else NULL. */
static void *link_poll(ucx_link *k, int kind, size_t *out_bytes) {
    ucp_tag_recv_info_t info;
    ucp_worker_progress(k->worker);
    ucp_tag_message_h msg = ucp_tag_probe_nb(k->worker, (uint64_t)kind << 32, TAG_MASK, 1, &info);
    if (msg == NULL) return NULL;
    void *buf = malloc(info.length > 0 ? info.length : 1);
    ucp_request_param_t p = {.op_attr_mask = 0};
    if (!buf || !link_wait(k, ucp_tag_msg_recv_nbx(k->worker, buf, info.length, msg, &p))) {
        free(buf);
        return NULL;
    }
    *out_bytes = info.length;
    return buf;
}

static void *link_recv(ucx_link *k, int kind, size_t *out_bytes) {
    for (double end = now() + WAIT_SECONDS; now() < end && !k->peer_gone;) {
        void *buf = link_poll(k, kind, out_bytes);
        if (buf) return buf;
    }
    fprintf(stderr, "%s: no message of kind %d (%s)\n", k->who, kind,
            k->peer_gone ? "the peer is gone" : "timed out");
    return NULL;
}

/* Closes in flush mode: what was sent is delivered first (a send completes locally before the
   peer has it), within the wait's deadline. */
static void link_close(ucx_link *k) {
    if (k->ep) {
        ucp_request_param_t p = {.op_attr_mask = 0};
        link_wait(k, ucp_ep_close_nbx(k->ep, &p));
    }
    if (k->listener) ucp_listener_destroy(k->listener);
    if (k->worker) ucp_worker_destroy(k->worker);
    if (k->context) ucp_cleanup(k->context);
}

/* ---- shared pieces --------------------------------------------------------------------------- */

typedef struct worker {
    const options *opt;
    const llama_model *model;
    llama_runner runner;
    llama_kv_cache cache;
    float *logits;
    char err[256];
} worker;

static bool worker_init(worker *w, const options *o, const llama_model *m, int64_t capacity) {
    memset(w, 0, sizeof *w);
    w->opt = o, w->model = m;
    w->logits = malloc((size_t)m->config.vocab * sizeof *w->logits);
    return w->logits &&
           llama_runner_init(&w->runner, m, o->threads, w->err, sizeof w->err) == LLAMA_OK &&
           kvmix_kv_create(kvmix_kv_policy_builtin("fp16"), &m->config, capacity, &w->cache, w->err,
                           sizeof w->err) == LLAMA_OK;
}

static void worker_free(worker *w) {
    if (w->cache.destroy) w->cache.destroy(w->cache.state);
    if (w->runner.model) llama_runner_free(&w->runner);
    free(w->logits);
}

/* Greedy tokens from `token` at position pos: out[0] = token, each next the argmax; before each
   step, between(w, ctx, step) when given. */
static bool generate(worker *w, int32_t token, int64_t pos, int32_t *out, int64_t n,
                     bool (*between)(worker *, void *, int64_t), void *ctx) {
    for (int64_t i = 0; i < n; i++) {
        out[i] = token;
        if (between && !between(w, ctx, i)) return false;
        if (llama_forward(&w->runner, &w->cache, token, pos + i, w->logits, w->err,
                          sizeof w->err) != LLAMA_OK)
            return false;
        token = llama_argmax(w->logits, w->model->config.vocab);
    }
    return true;
}

static void print_agreement(const char *who, const int32_t *mine, const int32_t *theirs, int64_t n,
                            double *out) {
    int64_t same = 0, first = -1;
    for (int64_t i = 0; i < n; i++) {
        same += mine[i] == theirs[i];
        if (first < 0 && mine[i] != theirs[i]) first = i;
    }
    *out = n > 0 ? (double)same / (double)n : 1.0;
    printf("%s: agreement with the untransferred run %.4f (%lld of %lld tokens; first "
           "difference at %lld)\n",
           who, *out, (long long)same, (long long)n, (long long)first);
}

static size_t layer_floats(const llama_config *c, int64_t n) {
    return (size_t)n * (size_t)c->n_kv_heads * (size_t)c->head_dim;
}

/* ---- the prefill worker ---------------------------------------------------------------------- */

/* The payload of layer l of the rows (keys, values: [n_layers][n][...]) at the tiers. */
static void *pack_layer(const llama_config *c, int32_t l, int64_t n, const uint8_t *tiers,
                        const float *keys, const float *values, kvmix_payload_kind kind,
                        size_t *out_bytes) {
    kvmix_payload_desc d = {kind,
                            c->head_dim,
                            c->n_kv_heads,
                            0,
                            l,
                            1,
                            (int32_t)n,
                            0,
                            kind == KVMIX_PAYLOAD_ROWS ? (uint64_t)l + 1 : (uint64_t)l + 101,
                            kind == KVMIX_PAYLOAD_ROWS ? 0 : (uint64_t)l + 1};
    kvmix_payload_info info;
    if (kvmix_payload_describe(&d, tiers, &info, NULL) != KVMIX_SUCCESS) return NULL;
    void *buf = malloc(info.total_bytes);
    size_t at = (size_t)l * layer_floats(c, n);
    if (buf && kvmix_payload_pack(&d, tiers, keys + at, values + at, buf, info.total_bytes,
                                  out_bytes, NULL) != KVMIX_SUCCESS) {
        free(buf);
        return NULL;
    }
    return buf;
}

/* Layer 0's payload broken as --inject says (another layer's payload for MISMATCH). */
static void *broken_payload(const worker *w, const void *good, size_t bytes, const void *above,
                            size_t above_bytes, size_t *out_bytes) {
    void *bad = malloc(bytes > above_bytes ? bytes : above_bytes);
    if (!bad) return NULL;
    *out_bytes = bytes;
    memcpy(bad, good, bytes);
    if (w->opt->inject == INJECT_TRUNCATE)
        *out_bytes = bytes / 2;
    else if (w->opt->inject == INJECT_CORRUPT)
        ((uint8_t *)bad)[KVMIX_PAYLOAD_HEADER_BYTES] = 0x7f; /* token 0's tier: no format */
    else
        memcpy(bad, above, above_bytes), *out_bytes = above_bytes;
    return bad;
}

static bool expect_status(ucx_link *k, int32_t layer, bool ok) {
    size_t bytes = 0;
    status_msg *s = link_recv(k, TAG_STATUS, &bytes);
    bool good = s && bytes == sizeof *s && s->layer == layer && (s->result == 0) == ok;
    if (s && !good)
        fprintf(stderr, "prefill: layer %d: status %d, expected %s\n", s->layer, s->result,
                ok ? "success" : "a refusal");
    if (s && good && !ok)
        printf("prefill: layer %d's broken payload was refused (%s)\n", layer,
               status_text(s->result));
    free(s);
    return good;
}

/* Streams the layers: each payload sent, its status awaited; *out_bytes: the payloads that were
   taken (a refused one is not counted). */
static bool send_layers(worker *w, ucx_link *k, int64_t n, const uint8_t *tiers, const float *keys,
                        const float *values, size_t *out_bytes) {
    const llama_config *c = &w->model->config;
    bool ok = true;
    *out_bytes = 0;
    for (int32_t l = 0; ok && l < c->n_layers; l++) {
        size_t bytes = 0, above_bytes = 0, bad_bytes = 0;
        void *payload = pack_layer(c, l, n, tiers, keys, values, KVMIX_PAYLOAD_ROWS, &bytes);
        void *above = l == 0 && w->opt->inject != INJECT_NONE
                          ? pack_layer(c, 1 % c->n_layers, n, tiers, keys, values,
                                       KVMIX_PAYLOAD_ROWS, &above_bytes)
                          : NULL;
        if (!payload) ok = false;
        if (ok && above) {
            void *bad = broken_payload(w, payload, bytes, above, above_bytes, &bad_bytes);
            ok = bad && link_send(k, TAG_LAYER, bad, bad_bytes) && expect_status(k, l, false);
            free(bad);
        }
        ok = ok && link_send(k, TAG_LAYER, payload, bytes) && expect_status(k, l, true);
        *out_bytes += bytes;
        free(payload), free(above);
    }
    return ok;
}

/* The residuals (originals - what the payloads decode to) of the asked tokens, per layer. */
static bool send_residuals(worker *w, ucx_link *k, int64_t n, const float *keys,
                           const float *values, const float *decoded_k, const float *decoded_v) {
    const llama_config *c = &w->model->config;
    size_t bytes = 0, total = 0, floats = (size_t)c->n_layers * layer_floats(c, n);
    int32_t *asked = link_recv(k, TAG_ASK, &bytes);
    uint8_t *tiers = calloc((size_t)n, 1);
    float *rk = malloc(floats * sizeof *rk), *rv = malloc(floats * sizeof *rv);
    bool ok = asked && tiers && rk && rv;
    for (size_t i = 0; ok && i < bytes / sizeof *asked; i++) {
        ok = asked[i] >= 0 && asked[i] < n;
        if (ok) tiers[asked[i]] = KVMIX_FORMAT_INT8;
    }
    for (size_t i = 0; ok && i < floats; i++)
        rk[i] = keys[i] - decoded_k[i], rv[i] = values[i] - decoded_v[i];
    double start = now();
    for (int32_t l = 0; ok && l < c->n_layers; l++) {
        size_t out = 0;
        void *payload = pack_layer(c, l, n, tiers, rk, rv, KVMIX_PAYLOAD_RESIDUAL, &out);
        ok = payload && link_send(k, TAG_RESIDUAL, payload, out);
        total += out;
        free(payload);
    }
    if (ok)
        printf("prefill: residuals of %zu asked tokens: %zu bytes in %.2f ms\n",
               bytes / sizeof *asked, total, 1e3 * (now() - start));
    free(asked), free(tiers), free(rk), free(rv);
    return ok;
}

/* This example sends every token: a budget below all-INT4 would drop some. */
static bool plan_sends_all(const kvmix_tier_plan *plan) {
    if (plan->n_dropped > 0)
        fprintf(stderr, "prefill: the budget is below all-INT4 (%d tokens would not be sent)\n",
                plan->n_dropped);
    return plan->n_dropped == 0;
}

static int run_prefill(const options *o, const llama_model *m, const int32_t *ids, int64_t n,
                       uint16_t port) {
    const llama_config *c = &m->config;
    worker w;
    ucx_link k;
    size_t floats = (size_t)c->n_layers * layer_floats(c, n), sent = 0, fp16_bytes = 0;
    float *keys = malloc(floats * sizeof *keys), *values = malloc(floats * sizeof *values);
    float *dk = malloc(floats * sizeof *dk), *dv = malloc(floats * sizeof *dv);
    uint8_t *tiers = malloc((size_t)n);
    int32_t *mine = malloc((size_t)o->generate * sizeof *mine);
    kvmix_tier_plan plan;
    transfer_setup setup = {TRANSFER_NORMS, o->budget, LAMBDA, N_SINKS, 1, 0, 0};
    bool ok = keys && values && dk && dv && tiers && mine &&
              worker_init(&w, o, m, n + o->generate + 1) && link_init(&k, "prefill") &&
              link_connect(&k, port);
    for (int64_t p = 0; ok && p < n; p++)
        ok = llama_forward(&w.runner, &w.cache, ids[p], p, w.logits, w.err, sizeof w.err) ==
             LLAMA_OK;
    request_msg req = {MAGIC,
                       1,
                       c->n_layers,
                       c->n_kv_heads,
                       c->head_dim,
                       (int32_t)n,
                       ok ? llama_argmax(w.logits, c->vocab) : 0,
                       (int32_t)o->generate};
    ok = ok && kvmix_kv_rows_read(&w.cache, n, keys, values) == LLAMA_OK &&
         transfer_choose(&setup, NULL, keys, values, c->n_layers, (int32_t)n, c->n_kv_heads,
                         c->head_dim, tiers, &plan, w.err, sizeof w.err) == KVMIX_SUCCESS &&
         plan_sends_all(&plan) && link_send(&k, TAG_REQUEST, &req, sizeof req);
    double start = now(); /* the layers' streaming, statuses included */
    ok = ok && send_layers(&w, &k, n, tiers, keys, values, &sent);
    double seconds = now() - start;
    if (ok) {
        memcpy(dk, keys, floats * sizeof *dk), memcpy(dv, values, floats * sizeof *dv);
        ok = transfer_round_trip(tiers, 0, dk, dv, c->n_layers, (int32_t)n, c->n_kv_heads,
                                 c->head_dim, &(size_t){0}, &fp16_bytes, w.err,
                                 sizeof w.err) == KVMIX_SUCCESS;
    }
    if (ok)
        printf("prefill: %lld tokens, %d layers: FP16 %d, INT8 %d, INT4 %d; %zu bytes sent "
               "(%.3f of all-FP16 %zu) in %.2f ms, %.1f MB/s\n",
               (long long)n, c->n_layers, plan.n_fp16, plan.n_int8, plan.n_int4, sent,
               (double)sent / (double)fp16_bytes, fp16_bytes, 1e3 * seconds,
               (double)sent / seconds / 1e6);
    ok = ok && send_residuals(&w, &k, n, keys, values, dk, dv) &&
         generate(&w, req.first_token, n, mine, o->generate, NULL, NULL);
    size_t bytes = 0;
    int32_t *theirs = ok ? link_recv(&k, TAG_TOKENS, &bytes) : NULL;
    double agreement = 0.0;
    ok = ok && theirs && bytes == (size_t)o->generate * sizeof *theirs &&
         link_send(&k, TAG_TOKENS, mine, bytes);
    if (ok) print_agreement("prefill", theirs, mine, o->generate, &agreement);
    if (!ok) fprintf(stderr, "prefill: failed%s%s\n", w.err[0] ? ": " : "", w.err);
    free(theirs), free(keys), free(values), free(dk), free(dv), free(tiers), free(mine);
    link_close(&k);
    worker_free(&w);
    return ok && agreement >= o->min_agreement ? 0 : 1;
}

/* ---- the decode worker ----------------------------------------------------------------------- */

/* What the cache holds, to show a refused payload changed nothing. */
typedef struct cache_mark {
    llama_kv_stats stats;
    kvmix_cache_seq_stats seq;
} cache_mark;

static cache_mark mark_of(const llama_kv_cache *cache) {
    cache_mark m;
    int32_t seq = -1;
    memset(&m, 0, sizeof m);
    cache->stats(cache->state, &m.stats);
    kvmix_cache_seq_stats_get(kvmix_kv_inner(cache, &seq), seq, &m.seq);
    return m;
}

/* Checks and ingests layer l's payload; the status it earns (0: ingested). */
/* Whether a payload's head is the one expected next: 0, a read_head error or NOT_THIS_REQUEST
   (its rows would not fit the buffers sized for the request). */
static int32_t check_head(const request_msg *req, kvmix_payload_kind kind, int32_t l,
                          const void *payload, size_t bytes) {
    kvmix_payload_info info;
    kvmix_result r = kvmix_payload_read_head(payload, bytes, &info, NULL, NULL);
    if (r != KVMIX_SUCCESS) return r;
    const kvmix_payload_desc *d = &info.desc;
    if (d->kind != kind || d->first_layer != l || d->n_layers != 1 ||
        d->n_tokens != req->n_prompt || d->first_position != 0 ||
        d->n_kv_heads != req->n_kv_heads || d->head_dim != req->head_dim)
        return NOT_THIS_REQUEST;
    return 0;
}

static int32_t ingest_layer(worker *w, const request_msg *req, int32_t l, const void *payload,
                            size_t bytes, float *k, float *v) {
    int32_t r = check_head(req, KVMIX_PAYLOAD_ROWS, l, payload, bytes);
    if (r != 0) return r;
    if ((r = kvmix_payload_unpack(payload, bytes, l, k, v, NULL)) != KVMIX_SUCCESS) return r;
    return kvmix_kv_ingest(&w->cache, l, 0, req->n_prompt, k, v) == LLAMA_OK ? 0
                                                                             : KVMIX_ERR_BAD_VALUE;
}

static bool receive_layers(worker *w, ucx_link *k, const request_msg *req, uint8_t *tiers,
                           size_t *out_bytes) {
    size_t floats = layer_floats(&w->model->config, req->n_prompt);
    float *kr = malloc(floats * sizeof *kr), *vr = malloc(floats * sizeof *vr);
    bool ok = kr && vr;
    *out_bytes = 0;
    for (int32_t l = 0; ok && l < req->n_layers;) {
        size_t bytes = 0;
        void *payload = link_recv(k, TAG_LAYER, &bytes);
        cache_mark before = mark_of(&w->cache);
        int32_t result =
            payload ? ingest_layer(w, req, l, payload, bytes, kr, vr) : KVMIX_ERR_MALFORMED;
        cache_mark after = mark_of(&w->cache);
        const uint8_t *table = NULL;
        kvmix_payload_info info;
        if (result == 0 && l == 0 &&
            kvmix_payload_read_head(payload, bytes, &info, &table, NULL) == KVMIX_SUCCESS)
            memcpy(tiers, table, (size_t)req->n_prompt);
        status_msg s = {l, result};
        ok = payload && link_send(k, TAG_STATUS, &s, sizeof s);
        if (result == 0) *out_bytes += bytes;
        if (result != 0) {
            bool unchanged = memcmp(&before, &after, sizeof before) == 0;
            printf("decode: layer %d: payload refused (%s), cache unchanged: %s\n", l,
                   status_text(result), unchanged ? "yes" : "NO");
            ok = ok && unchanged;
        } else
            l++;
        free(payload);
    }
    free(kr), free(vr);
    return ok;
}

/* The INT4 tokens of the sealed pages: the cold tier worth an upgrade. */
static int32_t cold_tokens(const worker *w, const request_msg *req, const uint8_t *tiers,
                           int32_t *out) {
    int32_t seq = -1, n = 0;
    const kvmix_cache *cache = kvmix_kv_inner(&w->cache, &seq);
    int32_t page = cache->desc.page_tokens, sealed = req->n_prompt / page * page;
    for (int32_t j = 0; j < sealed; j++)
        if (tiers[j] == KVMIX_FORMAT_INT4) out[n++] = j;
    return n;
}

/* Between decode steps: the residuals that arrived are added to their pages. */
typedef struct upgrade {
    ucx_link *k;
    const request_msg *req;
    float *rk, *rv; /* [n_layers][n_prompt][...] residuals received so far */
    int32_t layers_in, n_asked, step_done;
    size_t bytes;
} upgrade;

static bool apply_upgrade(worker *w, const upgrade *u) {
    const llama_config *c = &w->model->config;
    int32_t seq = -1, page = kvmix_kv_inner(&w->cache, &seq)->desc.page_tokens;
    size_t row = layer_floats(c, 1), n = (size_t)u->req->n_prompt;
    size_t page_floats = (size_t)c->n_layers * (size_t)page * row;
    float *pk = malloc(page_floats * sizeof *pk), *pv = malloc(page_floats * sizeof *pv);
    bool ok = pk && pv;
    for (int32_t first = 0; ok && first + page <= u->req->n_prompt; first += page) {
        for (int32_t l = 0; l < c->n_layers; l++) {
            size_t from = ((size_t)l * n + (size_t)first) * row, to = (size_t)l * page * row;
            memcpy(pk + to, u->rk + from, (size_t)page * row * sizeof *pk);
            memcpy(pv + to, u->rv + from, (size_t)page * row * sizeof *pv);
        }
        ok = kvmix_kv_upgrade(&w->cache, first, pk, pv) == LLAMA_OK;
    }
    free(pk), free(pv);
    return ok;
}

static bool take_residuals(worker *w, void *ctx, int64_t step) {
    upgrade *u = ctx;
    ucx_link *k = u->k;
    size_t bytes = 0;
    void *payload;
    while (u->layers_in < u->req->n_layers && (payload = link_poll(k, TAG_RESIDUAL, &bytes))) {
        int32_t l = u->layers_in++;
        size_t at = (size_t)l * layer_floats(&w->model->config, u->req->n_prompt);
        int32_t r = check_head(u->req, KVMIX_PAYLOAD_RESIDUAL, l, payload, bytes);
        if (r == 0) r = kvmix_payload_unpack(payload, bytes, l, u->rk + at, u->rv + at, NULL);
        free(payload);
        u->bytes += bytes;
        if (r != 0) {
            fprintf(stderr, "decode: residual of layer %d refused: %s\n", l, status_text(r));
            return false;
        }
    }
    if (u->layers_in < u->req->n_layers || u->step_done >= 0) return true;
    u->step_done = (int32_t)step;
    bool ok = apply_upgrade(w, u);
    printf("decode: %d cold tokens upgraded with %zu residual bytes before step %lld: %s\n",
           u->n_asked, u->bytes, (long long)step, ok ? "ok" : "FAILED");
    return ok;
}

static int run_decode(const options *o, const llama_model *m, ucx_link *k) {
    const llama_config *c = &m->config;
    worker w;
    size_t bytes = 0, received = 0;
    memset(&w, 0, sizeof w);
    request_msg *req = link_accept(k) ? link_recv(k, TAG_REQUEST, &bytes) : NULL;
    bool ok = req && bytes == sizeof *req && req->magic == MAGIC && req->version == 1 &&
              req->n_layers == c->n_layers && req->n_kv_heads == c->n_kv_heads &&
              req->head_dim == c->head_dim && req->n_prompt > 0 && req->n_generate == o->generate &&
              worker_init(&w, o, m, req->n_prompt + req->n_generate + 1);
    double start = now(); /* the layers' streaming, from the request on */
    size_t floats = ok ? (size_t)c->n_layers * layer_floats(c, req->n_prompt) : 1;
    uint8_t *tiers = ok ? malloc((size_t)req->n_prompt) : NULL;
    int32_t *asked = ok ? malloc((size_t)req->n_prompt * sizeof *asked) : NULL;
    int32_t *mine = malloc((size_t)o->generate * sizeof *mine);
    upgrade u = {k, req, calloc(floats, sizeof(float)), calloc(floats, sizeof(float)), 0, 0, -1, 0};
    ok = ok && tiers && asked && mine && u.rk && u.rv &&
         receive_layers(&w, k, req, tiers, &received);
    double seconds = now() - start;
    if (ok)
        printf("decode: %d layers ingested, %zu bytes received in %.2f ms, %.1f MB/s\n",
               req->n_layers, received, 1e3 * seconds, (double)received / seconds / 1e6);
    if (ok) {
        u.n_asked = cold_tokens(&w, req, tiers, asked);
        ok = link_send(k, TAG_ASK, asked, (size_t)u.n_asked * sizeof *asked);
    }
    ok = ok && generate(&w, req->first_token, req->n_prompt, mine, o->generate, take_residuals, &u);
    /* residuals still on the way after the last step are taken before the tokens go back */
    for (double end = now() + WAIT_SECONDS; ok && u.step_done < 0 && now() < end;)
        ok = take_residuals(&w, &u, o->generate);
    ok = ok && u.step_done >= 0 &&
         link_send(k, TAG_TOKENS, mine, (size_t)o->generate * sizeof *mine);
    int32_t *theirs = ok ? link_recv(k, TAG_TOKENS, &bytes) : NULL;
    double agreement = 0.0;
    ok = ok && theirs && bytes == (size_t)o->generate * sizeof *theirs;
    if (ok) print_agreement("decode", mine, theirs, o->generate, &agreement);
    if (!ok) fprintf(stderr, "decode: failed%s%s\n", w.err[0] ? ": " : "", w.err);
    free(theirs), free(req), free(tiers), free(asked), free(mine), free(u.rk), free(u.rv);
    if (w.model) worker_free(&w);
    return ok && agreement >= o->min_agreement ? 0 : 1;
}

/* ---- the program ----------------------------------------------------------------------------- */

/* The child: a listener on a free loopback port, told to the parent, then the decode worker. */
static int decode_worker(const options *o, const llama_model *m, int port_fd) {
    ucx_link server;
    uint16_t port = 0;
    bool ok = link_init(&server, "decode") && link_listen(&server, &port);
    if (!ok) fprintf(stderr, "decode: no UCX listener on loopback\n");
    ssize_t w = write(port_fd, &port, sizeof port);
    close(port_fd);
    int rc = ok && w == (ssize_t)sizeof port ? run_decode(o, m, &server) : 1;
    link_close(&server);
    return rc;
}

/* The decode worker's port (0: it has none). */
static bool read_port(int fd, uint16_t *port) {
    ssize_t got = read(fd, port, sizeof *port);
    close(fd);
    if (got == (ssize_t)sizeof *port && *port != 0) {
        printf("pd_transfer: decode worker listening on 127.0.0.1:%u\n", *port);
        return true;
    }
    return false;
}

/* Text `index` of the data file as ids: <|endoftext|>, then its tokens, at most max. */
static int32_t *prompt_ids(const options *o, const llama_model *m, int64_t *out_n) {
    size_t bytes = 0;
    char *data = llama_read_text(o->data, &bytes), *line = data;
    int32_t *ids = NULL;
    for (int64_t i = 0; line && i < o->text; i++)
        line = (line = strchr(line, '\n')) ? line + 1 : NULL;
    cJSON *doc = line ? cJSON_ParseWithOpts(line, NULL, 0) : NULL;
    const cJSON *text = cJSON_GetObjectItemCaseSensitive(doc, "text");
    if (cJSON_IsString(text)) {
        size_t n_text = strlen(text->valuestring);
        int64_t n = 0;
        ids = malloc((n_text + 1) * sizeof *ids);
        if (ids &&
            llama_tokenize(&m->tokenizer, text->valuestring, n_text, ids + 1, &n) == LLAMA_OK) {
            ids[0] = llama_special_id(&m->tokenizer, "<|endoftext|>");
            *out_n = n + 1 < o->prompt_tokens ? n + 1 : o->prompt_tokens;
        } else {
            free(ids);
            ids = NULL;
        }
    }
    cJSON_Delete(doc);
    free(data);
    return ids;
}

static bool parse_options(int argc, char **argv, options *o) {
    *o = (options){NULL, NULL, 0, 256, 32, 0.46, 0.9, INJECT_NONE, 2};
    const char *injects[] = {"none", "truncate", "corrupt", "mismatch"};
    for (int i = 1; i + 1 < argc; i += 2) {
        const char *a = argv[i], *v = argv[i + 1];
        char *end = NULL;
        if (strcmp(a, "--model") == 0)
            o->model = v;
        else if (strcmp(a, "--data") == 0)
            o->data = v;
        else if (strcmp(a, "--text") == 0)
            o->text = strtoll(v, &end, 10);
        else if (strcmp(a, "--prompt-tokens") == 0)
            o->prompt_tokens = strtoll(v, &end, 10);
        else if (strcmp(a, "--generate") == 0)
            o->generate = strtoll(v, &end, 10);
        else if (strcmp(a, "--budget") == 0)
            o->budget = strtod(v, &end);
        else if (strcmp(a, "--min-agreement") == 0)
            o->min_agreement = strtod(v, &end);
        else if (strcmp(a, "--threads") == 0)
            o->threads = (int)strtol(v, &end, 10);
        else if (strcmp(a, "--inject") == 0) {
            o->inject = -1;
            for (int j = 0; j < 4; j++)
                if (strcmp(v, injects[j]) == 0) o->inject = j;
        } else
            return false;
        if (end && *end) return false;
    }
    return argc % 2 == 1 && o->model && o->data && o->text >= 0 && o->prompt_tokens >= 2 &&
           o->generate >= 1 && o->generate <= 4096 && o->budget > 0.0 && o->budget <= 1.0 &&
           o->threads >= 1 && o->threads <= 64 && o->inject >= 0;
}

int main(int argc, char **argv) {
    options o;
    llama_model model;
    char err[256];
    int64_t n = 0;
    if (!parse_options(argc, argv, &o)) {
        fprintf(stderr, "usage: pd_transfer --model M.safetensors --data D.jsonl [--text K] "
                        "[--prompt-tokens N]\n"
                        "                   [--generate N] [--budget B] "
                        "[--inject truncate|corrupt|mismatch]\n"
                        "                   [--min-agreement A] [--threads N]\n");
        return 2;
    }
    if (llama_model_load(o.model, &model, err, sizeof err) != LLAMA_OK) {
        fprintf(stderr, "pd_transfer: %s: %s\n", o.model, err);
        return 1;
    }
    int32_t *ids = prompt_ids(&o, &model, &n);
    if (!ids || n + o.generate + 1 > model.config.context) {
        fprintf(stderr, "pd_transfer: no text %lld in %s, or it does not fit the context\n",
                (long long)o.text, o.data);
        llama_model_free(&model);
        return 1;
    }
    setvbuf(stdout, NULL, _IOLBF, 0);
    printf("pd_transfer: %s, text %lld, %lld prompt tokens, %lld to generate, budget %.2f\n",
           model.config.name, (long long)o.text, (long long)n, (long long)o.generate, o.budget);
    /* each process makes its own UCX context after the fork; the child's port comes back
       through a pipe */
    int fds[2];
    uint16_t port = 0;
    pid_t child = pipe(fds) == 0 ? fork() : -1;
    if (child == 0) {
        close(fds[0]);
        int rc = decode_worker(&o, &model, fds[1]);
        free(ids);
        llama_model_free(&model);
        exit(rc);
    }
    if (child > 0) close(fds[1]);
    int rc = child > 0 && read_port(fds[0], &port) ? run_prefill(&o, &model, ids, n, port) : 1;
    int status = 1;
    if (child > 0) {
        double end = now() + WAIT_SECONDS;
        while (waitpid(child, &status, WNOHANG) == 0 && now() < end)
            nanosleep(&(struct timespec){0, 10000000}, NULL);
        if (now() >= end) kill(child, SIGKILL), waitpid(child, &status, 0);
    }
    free(ids);
    llama_model_free(&model);
    bool child_ok = child > 0 && WIFEXITED(status) && WEXITSTATUS(status) == 0;
    printf("pd_transfer: prefill %s, decode %s\n", rc == 0 ? "ok" : "FAILED",
           child_ok ? "ok" : "FAILED");
    return rc == 0 && child_ok ? 0 : 1;
}

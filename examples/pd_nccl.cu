/* pd_nccl: prefill on some GPUs, decode on others; tiered transfer payloads GPU to GPU over NCCL.
 *
 *   pd_nccl --model M --data D [--ranks N] [--prefill P] [--texts K] [--prompt-tokens N]
 *           [--generate G] [--budget B] [--upgrade-after U] [--expect FILE] [--min-agreement A]
 *           [--inject truncate|corrupt] [--no-overlap] [--group-size G]
 *   pd_nccl --reference FILE --model M --data D [--texts K] [--prompt-tokens N] [--generate G]
 *   pd_nccl --bench --model M --data D [--prompt-tokens N] [--repeat R] [--group-size G]
 *
 * One thread per GPU, one NCCL communicator over all of them (NCCL_NVLS_ENABLE=0: no NVLink
 * multicast). Ranks [0, P) prefill, the rest decode; text t goes from prefill rank t % P to
 * decode rank P + t % (N - P) (pd_nccl_plan.h). Texts are the first K of the data file, each cut
 * to its first N tokens.
 *
 * Prefill rank, per text: gpu_llama_prefill over the prompt with an fp16 kvmix cache, the rows
 * read back on the device (gpu_llama_rows_read_device), each token's tier at budget B
 * (transfer_plan.h: the key/value-norm statistic, recency decay 0.005, 4 sinks; INT8 and INT4
 * rows in groups of G channels, default 32), then one ROWS
 * payload per layer packed on the GPU (kvmix_payload_write_head + kvmix_cuda_payload_pack) and
 * sent with ncclSend straight from device memory, each after a 64-byte frame; the send of layer k
 * runs on its own stream while layer k + 1 packs (pd_schedule; --no-overlap waits for each).
 * It then waits for the decode rank's ask and sends RESIDUAL payloads (INT8 residuals of the
 * asked tokens, packed on the GPU) before its next text.
 *
 * Decode rank: receives each payload into device memory, checks its frame and head on the host
 * and unpacks it on the GPU (kvmix_cuda_payload_unpack) into staged rows; a payload refused
 * there is reported and changes nothing (the cache is written only once every layer is in), and
 * the sender's good copy follows (--inject). The rows enter its own device-arena cache
 * (gpu_llama_rows_ingest_device) and the sequence joins the running batch: every step runs one
 * token of every running sequence (continuous batching; batch-invariant, so a sequence's
 * tokens do not depend on its neighbours). U steps after it joined, the rank asks for the
 * residuals of the sequence's INT4 tokens, adds them to the staged rows on the GPU and moves the
 * sequence onto the upgraded rows (a device arena re-tiers pages only from their own rows, so the
 * sequence is ingested again: its prompt upgraded, its generated rows as they were).
 *
 * --reference runs the same texts on one GPU (prefill, then G greedy tokens) and writes
 * "TEXT: tokens" lines; --expect compares every decoded token with them and prints the
 * agreement (it must be at least --min-agreement, default 1). --bench (two ranks) measures one
 * text: payload bytes and time per layer for FP16 and the tiered payloads at b = 0.5 and 0.3
 * against a plain ncclSend of the same bytes, and time to the first decoded token with and
 * without the overlap, as one table. Every token is sent: a budget under what that takes (4 FP16
 * sinks and INT4 for the rest: 0.32 of FP16 at a group size of 32, 0.29 at 64, for 256
 * tokens of 128 channels) is refused at the start. Exit status 0 only when every check passed.
 */
#include <cjson/cJSON.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <nccl.h>

#include <math.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <vector>

extern "C" {
#include "gpu_llama.h"
#include "kvmix_cuda.h"
#include "kvmix_kv.h"
#include "pd_nccl_plan.h"
#include "transfer_plan.h"
}

namespace {

enum { N_SINKS = 4, N_SLOTS = 2, INJECT_NONE = 0, INJECT_TRUNCATE, INJECT_CORRUPT };
#define LAMBDA 0.005

struct options {
    const char *model, *data, *expect, *reference;
    int32_t ranks, prefill, texts, prompt_tokens, generate, upgrade_after, repeat, inject;
    int32_t group_size; /* of the INT8/INT4 rows; 0 = KVMIX_GROUP_SIZE_DEFAULT */
    double budget, min_agreement;
    bool overlap, bench;
};

double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

/* A rank's failure: one line into its error buffer, false returned. */
bool fail(char *err, size_t err_bytes, const char *fmt, ...) {
    va_list a;
    va_start(a, fmt);
    vsnprintf(err, err_bytes, fmt, a);
    va_end(a);
    return false;
}

#define CUDA_OK(call, what)                                                                        \
    do {                                                                                           \
        cudaError_t e_ = (call);                                                                   \
        if (e_ != cudaSuccess)                                                                     \
            return fail(w->err, sizeof w->err, "%s: %s", what, cudaGetErrorString(e_));            \
    } while (0)
#define NCCL_OK(call, what)                                                                        \
    do {                                                                                           \
        ncclResult_t n_ = (call);                                                                  \
        if (n_ != ncclSuccess)                                                                     \
            return fail(w->err, sizeof w->err, "%s: %s", what, ncclGetErrorString(n_));            \
    } while (0)
#define KVMIX_OK(call, what)                                                                       \
    do {                                                                                           \
        kvmix_result k_ = (call);                                                                  \
        if (k_ != KVMIX_SUCCESS)                                                                   \
            return fail(w->err, sizeof w->err, "%s: %s", what, kvmix_result_string(k_));           \
    } while (0)
#define LLAMA_OK_(call)                                                                            \
    do {                                                                                           \
        if ((call) != LLAMA_OK) return false;                                                      \
    } while (0)

/* ---- what every rank shares -------------------------------------------------------------- */

struct shared_run {
    const options *o;
    const llama_model *model;
    std::vector<std::vector<int32_t>> prompts;  /* [texts] */
    std::vector<std::vector<int32_t>> expected; /* [texts] from --expect, empty without */
    ncclUniqueId id;
    pthread_barrier_t barrier;
    double ttft_start; /* --bench: when the timed prefill began (one clock: one process) */
};

/* One GPU's worker. */
struct worker {
    shared_run *run;
    int32_t rank;
    pd_layout layout;
    ncclComm_t comm;
    cudaStream_t pack, send; /* the sender's two streams; the receiver uses `send` */
    gpu_llama *g;
    int32_t *d_flags;
    uint8_t *d_frame; /* [PD_FRAME_BYTES] */
    void *work;
    size_t work_bytes;
    int rc;
    char err[512];
    /* what a decode rank found */
    int64_t same, compared, refused, refused_unchanged;
};

const llama_config *config_of(const worker *w) { return &w->run->model->config; }
size_t row_halves(const llama_config *c) { return (size_t)c->n_kv_heads * c->head_dim; }

/* A device buffer of halves, NULL when out of memory. */
__half *halves(size_t n) {
    void *p = NULL;
    return cudaMalloc(&p, (n > 0 ? n : 1) * sizeof(__half)) == cudaSuccess ? (__half *)p : NULL;
}

/* ---- frames on the wire -------------------------------------------------------------------- */

bool send_frame(worker *w, const pd_frame *f, int32_t peer, cudaStream_t s) {
    uint8_t bytes[PD_FRAME_BYTES];
    pd_frame_encode(f, bytes);
    /* the frame's own device bytes: copied synchronously in stream order before its send */
    CUDA_OK(cudaMemcpyAsync(w->d_frame, bytes, sizeof bytes, cudaMemcpyHostToDevice, s), "frame");
    CUDA_OK(cudaStreamSynchronize(s), "frame");
    NCCL_OK(ncclSend(w->d_frame, PD_FRAME_BYTES, ncclUint8, peer, w->comm, s), "sending a frame");
    return true;
}

bool recv_frame(worker *w, int32_t peer, uint64_t max_payload, pd_frame *out) {
    uint8_t bytes[PD_FRAME_BYTES];
    NCCL_OK(ncclRecv(w->d_frame, PD_FRAME_BYTES, ncclUint8, peer, w->comm, w->send),
            "receiving a frame");
    CUDA_OK(cudaMemcpyAsync(bytes, w->d_frame, sizeof bytes, cudaMemcpyDeviceToHost, w->send),
            "frame");
    CUDA_OK(cudaStreamSynchronize(w->send), "frame");
    KVMIX_OK(pd_frame_decode(bytes, sizeof bytes, max_payload, out), "a frame");
    return true;
}

/* Bytes of a payload of n tokens all at FP16: the most a ROWS or RESIDUAL payload takes. */
uint64_t fp16_payload_bytes(const llama_config *c, int32_t n) {
    std::vector<uint8_t> tiers((size_t)(n > 0 ? n : 1), KVMIX_FORMAT_FP16);
    kvmix_payload_desc d = {KVMIX_PAYLOAD_ROWS, c->head_dim, c->n_kv_heads, 0, 0, 1, n, 0, 1, 0};
    kvmix_payload_info info;
    return kvmix_payload_describe(&d, tiers.data(), &info, NULL) == KVMIX_SUCCESS ? info.total_bytes
                                                                                  : 0;
}

/* ---- the sender's layers ------------------------------------------------------------------- */

/* One sequence's payloads: the same tiers for every layer, so one size; heads per layer. */
struct layer_payloads {
    kvmix_payload_kind kind;
    int32_t text, n_tokens;
    const uint8_t *tiers;
    const __half *keys, *values; /* [n_layers][n_tokens][row] */
    kvmix_payload_info info;     /* of layer 0; layer l differs in first_layer and id */
    uint8_t *slots[N_SLOTS];
    cudaEvent_t packed[N_SLOTS], sent[N_SLOTS];
    std::vector<cudaEvent_t> send_start, send_end; /* [n_layers]: timing of each send */
};

kvmix_payload_desc layer_desc(const worker *w, kvmix_payload_kind kind, int32_t text, int32_t l,
                              int32_t n) {
    const llama_config *c = config_of(w);
    uint64_t id = ((uint64_t)text << 20) + (uint64_t)l * 2 + 1;
    return kvmix_payload_desc{kind,
                              c->head_dim,
                              c->n_kv_heads,
                              w->run->o->group_size,
                              l,
                              1,
                              n,
                              0,
                              kind == KVMIX_PAYLOAD_ROWS ? id : id + 1,
                              kind == KVMIX_PAYLOAD_ROWS ? 0 : id};
}

/* Layer l's head written on the host, copied into `dst` and the body packed on stream s. */
bool pack_layer(worker *w, const layer_payloads *p, int32_t l, uint8_t *dst, cudaStream_t s) {
    const llama_config *c = config_of(w);
    kvmix_payload_desc d = layer_desc(w, p->kind, p->text, l, p->n_tokens);
    kvmix_payload_info info;
    std::vector<uint8_t> head(p->info.head_bytes);
    KVMIX_OK(kvmix_payload_describe(&d, p->tiers, &info, NULL), "describing a payload");
    KVMIX_OK(kvmix_payload_write_head(&info, p->tiers, head.data(), head.size(), NULL), "a head");
    CUDA_OK(cudaMemcpyAsync(dst, head.data(), head.size(), cudaMemcpyHostToDevice, s), "a head");
    CUDA_OK(cudaStreamSynchronize(s), "a head"); /* head is host memory that goes away */
    size_t layer = (size_t)p->n_tokens * row_halves(c) * (size_t)l;
    KVMIX_OK(kvmix_cuda_payload_pack(&info, p->keys + layer, p->values + layer, KVMIX_CUDA_FP16,
                                     dst, w->work, w->work_bytes, w->d_flags, s),
             "packing a payload");
    return true;
}

/* A frame and its payload of `bytes` from dst, on stream s, timed by the layer's events. */
bool send_payload(worker *w, layer_payloads *p, int32_t l, const uint8_t *src, uint64_t bytes,
                  int32_t peer, cudaStream_t s) {
    pd_frame f = {p->kind == KVMIX_PAYLOAD_ROWS ? PD_FRAME_LAYER : PD_FRAME_RESIDUAL,
                  p->text,
                  l,
                  0,
                  0,
                  0,
                  bytes};
    if (!send_frame(w, &f, peer, s)) return false;
    CUDA_OK(cudaEventRecord(p->send_start[l], s), "timing");
    NCCL_OK(ncclSend(src, bytes, ncclUint8, peer, w->comm, s), "sending a payload");
    CUDA_OK(cudaEventRecord(p->send_end[l], s), "timing");
    return true;
}

/* Runs the per-layer schedule (pd_schedule) over every layer. */
bool send_layers(worker *w, layer_payloads *p, int32_t peer, bool overlap) {
    int32_t n_layers = config_of(w)->n_layers;
    int32_t n = pd_schedule(n_layers, N_SLOTS, overlap, NULL, 0);
    std::vector<pd_op> ops((size_t)(n > 0 ? n : 1));
    if (n < 0 || pd_schedule(n_layers, N_SLOTS, overlap, ops.data(), n) != n)
        return fail(w->err, sizeof w->err, "no schedule for %d layers", n_layers);
    bool ok = true;
    for (int32_t i = 0; ok && i < n; i++) {
        const pd_op &o = ops[(size_t)i];
        uint8_t *slot = p->slots[o.slot];
        switch (o.kind) {
        case PD_OP_WAIT_SENT:
            ok = cudaStreamWaitEvent(w->pack, p->sent[o.slot], 0) == cudaSuccess;
            break;
        case PD_OP_PACK: ok = pack_layer(w, p, o.layer, slot, w->pack); break;
        case PD_OP_PACKED: ok = cudaEventRecord(p->packed[o.slot], w->pack) == cudaSuccess; break;
        case PD_OP_WAIT_PACKED:
            ok = cudaStreamWaitEvent(w->send, p->packed[o.slot], 0) == cudaSuccess;
            break;
        case PD_OP_SEND:
            ok = send_payload(w, p, o.layer, slot, p->info.total_bytes, peer, w->send);
            break;
        case PD_OP_SENT: ok = cudaEventRecord(p->sent[o.slot], w->send) == cudaSuccess; break;
        case PD_OP_HOST_WAIT_PACK: ok = cudaStreamSynchronize(w->pack) == cudaSuccess; break;
        case PD_OP_HOST_WAIT_SEND: ok = cudaStreamSynchronize(w->send) == cudaSuccess; break;
        default: ok = false;
        }
        if (!ok && !w->err[0])
            fail(w->err, sizeof w->err, "schedule op %d of layer %d failed", o.kind, o.layer);
    }
    CUDA_OK(cudaStreamSynchronize(w->send), "sending layers");
    return ok;
}

bool payloads_init(worker *w, layer_payloads *p, kvmix_payload_kind kind, int32_t text, int32_t n,
                   const uint8_t *tiers, const __half *keys, const __half *values) {
    const llama_config *c = config_of(w);
    p->kind = kind, p->text = text, p->n_tokens = n, p->tiers = tiers;
    p->keys = keys, p->values = values;
    kvmix_payload_desc d = layer_desc(w, kind, text, 0, n);
    KVMIX_OK(kvmix_payload_describe(&d, tiers, &p->info, NULL), "describing a payload");
    p->send_start.assign((size_t)c->n_layers, NULL);
    p->send_end.assign((size_t)c->n_layers, NULL);
    for (int i = 0; i < N_SLOTS; i++) {
        CUDA_OK(cudaMalloc(&p->slots[i], p->info.total_bytes), "payload slots");
        CUDA_OK(cudaEventCreateWithFlags(&p->packed[i], cudaEventDisableTiming), "events");
        CUDA_OK(cudaEventCreateWithFlags(&p->sent[i], cudaEventDisableTiming), "events");
    }
    for (int32_t l = 0; l < c->n_layers; l++) {
        CUDA_OK(cudaEventCreate(&p->send_start[(size_t)l]), "events");
        CUDA_OK(cudaEventCreate(&p->send_end[(size_t)l]), "events");
    }
    return true;
}

void payloads_free(layer_payloads *p) {
    for (int i = 0; i < N_SLOTS; i++) {
        cudaFree(p->slots[i]);
        if (p->packed[i]) cudaEventDestroy(p->packed[i]);
        if (p->sent[i]) cudaEventDestroy(p->sent[i]);
    }
    for (size_t l = 0; l < p->send_start.size(); l++) {
        if (p->send_start[l]) cudaEventDestroy(p->send_start[l]);
        if (p->send_end[l]) cudaEventDestroy(p->send_end[l]);
    }
}

/* Seconds each layer's send took, summed over layers. */
double send_seconds(const layer_payloads *p) {
    double sum = 0.0;
    for (size_t l = 0; l < p->send_start.size(); l++) {
        float ms = 0.0f;
        if (cudaEventElapsedTime(&ms, p->send_start[l], p->send_end[l]) == cudaSuccess)
            sum += 1e-3 * ms;
    }
    return sum;
}

/* Nonzero device flags of the kernel pack end the run. */
bool flags_clear(worker *w, const char *what) {
    int32_t flags = 0;
    CUDA_OK(cudaMemcpy(&flags, w->d_flags, sizeof flags, cudaMemcpyDeviceToHost), what);
    CUDA_OK(cudaMemset(w->d_flags, 0, sizeof flags), what);
    return flags == 0 || fail(w->err, sizeof w->err, "%s: device flags %d", what, flags);
}

/* ---- the prefill rank ---------------------------------------------------------------------- */

__global__ void residual_kernel(const __half *orig, const __half *decoded, size_t n, __half *out) {
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (size_t)gridDim.x * blockDim.x)
        out[i] = __float2half_rn(__half2float(orig[i]) - __half2float(decoded[i]));
}

/* A prefilled sequence's rows on the device and each token's tier. */
struct prefilled {
    int32_t text, n, first_token;
    __half *keys, *values; /* [n_layers][n][row] */
    std::vector<uint8_t> tiers;
    kvmix_tier_plan plan;
};

void prefilled_free(prefilled *s) { cudaFree(s->keys), cudaFree(s->values); }

/* The text through the model, its rows read back on the device, the first greedy token. */
bool prefill_rows(worker *w, int32_t text, prefilled *s) {
    const llama_config *c = config_of(w);
    const std::vector<int32_t> &ids = w->run->prompts[(size_t)text];
    int32_t seq = -1, n = (int32_t)ids.size();
    std::vector<float> logits((size_t)n * c->vocab);
    s->text = text, s->n = n;
    LLAMA_OK_(gpu_llama_seq_start(w->g, &seq, w->err, sizeof w->err));
    bool ok = gpu_llama_prefill(w->g, seq, ids.data(), n, logits.data(), w->err, sizeof w->err) ==
              LLAMA_OK;
    size_t all = (size_t)c->n_layers * n * row_halves(c);
    s->keys = halves(all), s->values = halves(all);
    ok = ok && (s->keys && s->values ? true : fail(w->err, sizeof w->err, "rows: out of memory"));
    ok = ok && gpu_llama_rows_read_device(w->g, seq, s->keys, s->values, w->err, sizeof w->err) ==
                   LLAMA_OK;
    gpu_llama_seq_end(w->g, seq);
    if (ok) s->first_token = llama_argmax(logits.data() + (size_t)(n - 1) * c->vocab, c->vocab);
    return ok;
}

/* Each token's tier at `budget` from the rows' norms (a host copy of the device rows). */
bool choose_tiers(worker *w, prefilled *s, double budget) {
    const llama_config *c = config_of(w);
    size_t all = (size_t)c->n_layers * s->n * row_halves(c);
    std::vector<__half> hk(all), hv(all);
    std::vector<float> fk(all), fv(all);
    CUDA_OK(cudaMemcpy(hk.data(), s->keys, all * sizeof(__half), cudaMemcpyDeviceToHost), "rows");
    CUDA_OK(cudaMemcpy(hv.data(), s->values, all * sizeof(__half), cudaMemcpyDeviceToHost), "rows");
    for (size_t i = 0; i < all; i++) fk[i] = __half2float(hk[i]), fv[i] = __half2float(hv[i]);
    transfer_setup setup = {
        TRANSFER_NORMS,        budget, LAMBDA, N_SINKS < s->n ? N_SINKS : s->n, 1,
        w->run->o->group_size, 0};
    s->tiers.assign((size_t)s->n, 0);
    if (transfer_choose(&setup, NULL, fk.data(), fv.data(), c->n_layers, s->n, c->n_kv_heads,
                        c->head_dim, s->tiers.data(), &s->plan, w->err,
                        sizeof w->err) != KVMIX_SUCCESS)
        return false;
    return s->plan.n_dropped == 0 ||
           fail(w->err, sizeof w->err, "budget %.2f is below all-INT4: %d tokens would not be sent",
                budget, s->plan.n_dropped);
}

/* Layer 0 sent once broken (--inject) before the schedule sends the good one. */
bool send_broken(worker *w, layer_payloads *p, int32_t peer) {
    uint64_t bytes = p->info.total_bytes;
    if (!pack_layer(w, p, 0, p->slots[0], w->send)) return false;
    if (w->run->o->inject == INJECT_TRUNCATE)
        bytes /= 2;
    else /* token 0's tier: no format */
        CUDA_OK(cudaMemsetAsync(p->slots[0] + KVMIX_PAYLOAD_HEADER_BYTES, 0x7f, 1, w->send),
                "inject");
    if (!send_payload(w, p, 0, p->slots[0], bytes, peer, w->send)) return false;
    CUDA_OK(cudaStreamSynchronize(w->send), "inject");
    printf("prefill %d: text %d: layer 0 sent %s\n", w->rank, p->text,
           w->run->o->inject == INJECT_TRUNCATE ? "cut short" : "with a corrupt tier table");
    return true;
}

/* The sequence's ROWS payloads, every layer after its frame; *out_seconds: the sends' time. */
bool send_sequence(worker *w, const prefilled *s, int32_t peer, bool overlap, bool inject,
                   double *out_seconds, uint64_t *out_bytes) {
    layer_payloads p = {};
    bool ok = payloads_init(w, &p, KVMIX_PAYLOAD_ROWS, s->text, s->n, s->tiers.data(), s->keys,
                            s->values);
    pd_frame head = {PD_FRAME_SEQUENCE, s->text,           0, config_of(w)->n_layers, s->n,
                     s->first_token,    p.info.total_bytes};
    ok = ok && send_frame(w, &head, peer, w->send);
    ok = ok && (!inject || send_broken(w, &p, peer));
    ok = ok && send_layers(w, &p, peer, overlap) && flags_clear(w, "packing");
    if (ok && out_seconds) *out_seconds = send_seconds(&p);
    if (ok && out_bytes) *out_bytes = p.info.total_bytes;
    payloads_free(&p);
    return ok;
}

/* The residuals (rows - what their ROWS payload decodes to) of every layer, on the device. */
bool residual_rows(worker *w, const prefilled *s, __half *rk, __half *rv) {
    const llama_config *c = config_of(w);
    size_t layer = (size_t)s->n * row_halves(c);
    layer_payloads p = {};
    __half *dk = halves(layer), *dv = halves(layer);
    bool ok = dk && dv &&
              payloads_init(w, &p, KVMIX_PAYLOAD_ROWS, s->text, s->n, s->tiers.data(), s->keys,
                            s->values);
    for (int32_t l = 0; ok && l < c->n_layers; l++) {
        ok = pack_layer(w, &p, l, p.slots[0], w->pack);
        kvmix_payload_desc d = layer_desc(w, KVMIX_PAYLOAD_ROWS, s->text, l, s->n);
        kvmix_payload_info info;
        ok = ok && kvmix_payload_describe(&d, s->tiers.data(), &info, NULL) == KVMIX_SUCCESS &&
             kvmix_cuda_payload_unpack(&info, p.slots[0], KVMIX_CUDA_FP16, dk, dv, w->work,
                                       w->work_bytes, w->d_flags, w->pack) == KVMIX_SUCCESS;
        if (!ok) break;
        size_t at = (size_t)l * layer;
        residual_kernel<<<64, 256, 0, w->pack>>>(s->keys + at, dk, layer, rk + at);
        residual_kernel<<<64, 256, 0, w->pack>>>(s->values + at, dv, layer, rv + at);
        ok = cudaStreamSynchronize(w->pack) == cudaSuccess;
    }
    if (!ok && !w->err[0]) fail(w->err, sizeof w->err, "computing residuals failed");
    payloads_free(&p);
    cudaFree(dk), cudaFree(dv);
    return ok && flags_clear(w, "residuals");
}

/* The decode rank's ask (positions of its cold tokens), answered with RESIDUAL payloads of
   INT8 residuals for them. */
bool serve_residuals(worker *w, const prefilled *s, int32_t peer) {
    const llama_config *c = config_of(w);
    pd_frame ask;
    if (!recv_frame(w, peer, 0, &ask)) return false;
    if (ask.kind != PD_FRAME_ASK || ask.text != s->text || ask.n_tokens > s->n)
        return fail(w->err, sizeof w->err, "expected an ask for text %d", s->text);
    if (ask.n_tokens == 0) return true;
    int32_t *d_asked = NULL;
    std::vector<int32_t> asked((size_t)ask.n_tokens);
    CUDA_OK(cudaMalloc(&d_asked, asked.size() * sizeof(int32_t)), "asked positions");
    bool ok = ncclRecv(d_asked, asked.size(), ncclInt32, peer, w->comm, w->send) == ncclSuccess &&
              cudaMemcpyAsync(asked.data(), d_asked, asked.size() * sizeof(int32_t),
                              cudaMemcpyDeviceToHost, w->send) == cudaSuccess &&
              cudaStreamSynchronize(w->send) == cudaSuccess;
    cudaFree(d_asked);
    std::vector<uint8_t> tiers((size_t)s->n, KVMIX_PAYLOAD_NO_ROW);
    for (size_t i = 0; ok && i < asked.size(); i++) {
        ok = asked[i] >= 0 && asked[i] < s->n;
        if (ok) tiers[(size_t)asked[i]] = KVMIX_FORMAT_INT8;
    }
    if (!ok) return fail(w->err, sizeof w->err, "text %d: a bad ask", s->text);
    size_t all = (size_t)c->n_layers * s->n * row_halves(c);
    __half *rk = halves(all), *rv = halves(all);
    layer_payloads p = {};
    double start = now();
    ok = rk && rv && residual_rows(w, s, rk, rv) &&
         payloads_init(w, &p, KVMIX_PAYLOAD_RESIDUAL, s->text, s->n, tiers.data(), rk, rv) &&
         send_layers(w, &p, peer, true) && flags_clear(w, "packing residuals");
    if (ok)
        printf("prefill %d: text %d: residuals of %d asked tokens, %d x %zu bytes in %.2f ms\n",
               w->rank, s->text, ask.n_tokens, c->n_layers, p.info.total_bytes,
               1e3 * (now() - start));
    payloads_free(&p);
    cudaFree(rk), cudaFree(rv);
    return ok;
}

bool run_prefill(worker *w) {
    const options *o = w->run->o;
    std::vector<int32_t> texts((size_t)o->texts);
    int32_t n = pd_rank_texts(&w->layout, w->rank, o->texts, texts.data());
    bool ok = true;
    for (int32_t i = 0; ok && i < n; i++) {
        prefilled s = {};
        int32_t peer = pd_text_decode_rank(&w->layout, texts[(size_t)i]);
        double seconds = 0.0;
        uint64_t bytes = 0;
        ok = prefill_rows(w, texts[(size_t)i], &s) && choose_tiers(w, &s, o->budget) &&
             send_sequence(w, &s, peer, o->overlap, o->inject != INJECT_NONE && i == 0, &seconds,
                           &bytes);
        if (ok)
            printf("prefill %d: text %d -> rank %d: %d tokens (FP16 %d, INT8 %d, INT4 %d), "
                   "%d x %llu bytes in %.3f ms of sends\n",
                   w->rank, s.text, peer, s.n, s.plan.n_fp16, s.plan.n_int8, s.plan.n_int4,
                   config_of(w)->n_layers, (unsigned long long)bytes, 1e3 * seconds);
        ok = ok && serve_residuals(w, &s, peer);
        prefilled_free(&s);
    }
    return ok;
}

/* ---- the decode rank ----------------------------------------------------------------------- */

/* A sequence the decode rank runs. */
struct running {
    int32_t text, seq, n_prompt, peer;
    std::vector<int32_t> tokens; /* tokens[0] the prefill's first token */
    std::vector<uint8_t> tiers;
    int32_t steps;
    bool upgraded;
};

/* What the cache holds for every running sequence, to show a refusal changed nothing. */
std::vector<llama_kv_stats> cache_mark(const worker *w, const std::vector<running> &live) {
    std::vector<llama_kv_stats> m(live.size());
    for (size_t i = 0; i < live.size(); i++) {
        memset(&m[i], 0, sizeof m[i]);
        gpu_llama_seq_stats(w->g, live[i].seq, &m[i]);
    }
    return m;
}

/* Whether a payload's head is the one expected: 0 or a kvmix_result; *info on success. */
int32_t check_payload(const worker *w, const uint8_t *d_payload, uint64_t bytes,
                      kvmix_payload_kind kind, int32_t layer, int32_t n, kvmix_payload_info *info,
                      std::vector<uint8_t> *tiers) {
    const llama_config *c = config_of(w);
    std::vector<uint8_t> head((size_t)(bytes < KVMIX_PAYLOAD_HEADER_BYTES + (uint64_t)n + 16
                                           ? bytes
                                           : KVMIX_PAYLOAD_HEADER_BYTES + (uint64_t)n + 16));
    const uint8_t *table = NULL;
    if (cudaMemcpy(head.data(), d_payload, head.size(), cudaMemcpyDeviceToHost) != cudaSuccess)
        return KVMIX_ERR_CUDA;
    kvmix_result r = kvmix_payload_read_head(head.data(), head.size(), info, &table, NULL);
    if (r != KVMIX_SUCCESS) return r;
    const kvmix_payload_desc *d = &info->desc;
    if (d->kind != kind || d->first_layer != layer || d->n_layers != 1 || d->n_tokens != n ||
        d->first_position != 0 || d->n_kv_heads != c->n_kv_heads || d->head_dim != c->head_dim)
        return KVMIX_ERR_INVALID_ARGUMENT;
    if (info->total_bytes != bytes) return KVMIX_ERR_BUFFER_TOO_SMALL;
    if (tiers) tiers->assign(table, table + n);
    return 0;
}

/* Layer payloads of one kind received until every layer is in: each checked and unpacked into
   rows (ROWS: written; RESIDUAL: added), a refused one reported and taken again. */
bool receive_layers(worker *w, const std::vector<running> &live, int32_t text, int32_t peer,
                    int32_t n, kvmix_payload_kind kind, __half *keys, __half *values,
                    std::vector<uint8_t> *tiers) {
    const llama_config *c = config_of(w);
    uint64_t max_bytes = fp16_payload_bytes(c, n);
    size_t layer = (size_t)n * row_halves(c);
    uint8_t *d_payload = NULL;
    CUDA_OK(cudaMalloc(&d_payload, max_bytes), "a payload buffer");
    bool ok = true;
    for (int32_t l = 0; ok && l < c->n_layers;) {
        pd_frame f;
        kvmix_payload_info info;
        ok = recv_frame(w, peer, max_bytes, &f);
        int32_t want = kind == KVMIX_PAYLOAD_ROWS ? PD_FRAME_LAYER : PD_FRAME_RESIDUAL;
        if (ok && (f.kind != want || f.text != text || f.layer != l))
            ok = fail(w->err, sizeof w->err, "text %d layer %d: an unexpected frame", text, l);
        ok = ok &&
             ncclRecv(d_payload, f.payload_bytes, ncclUint8, peer, w->comm, w->send) ==
                 ncclSuccess &&
             cudaStreamSynchronize(w->send) == cudaSuccess;
        if (!ok) break;
        std::vector<llama_kv_stats> before = cache_mark(w, live);
        int32_t r =
            check_payload(w, d_payload, f.payload_bytes, kind, l, n, &info, l == 0 ? tiers : NULL);
        if (r == 0 && kvmix_cuda_payload_unpack(&info, d_payload, KVMIX_CUDA_FP16, keys + l * layer,
                                                values + l * layer, w->work, w->work_bytes,
                                                w->d_flags, w->send) != KVMIX_SUCCESS)
            r = KVMIX_ERR_CUDA;
        int32_t flags = 0;
        if (r == 0 &&
            cudaMemcpy(&flags, w->d_flags, sizeof flags, cudaMemcpyDeviceToHost) != cudaSuccess)
            r = KVMIX_ERR_CUDA;
        if (r == 0 && flags != 0) r = KVMIX_ERR_CORRUPT_DATA;
        cudaMemset(w->d_flags, 0, sizeof flags);
        if (r == 0) {
            l++;
            continue;
        }
        std::vector<llama_kv_stats> after = cache_mark(w, live);
        bool same = before.size() == after.size() &&
                    (before.empty() ||
                     memcmp(before.data(), after.data(), before.size() * sizeof before[0]) == 0);
        w->refused++, w->refused_unchanged += same;
        printf("decode %d: text %d layer %d: payload refused (%s), cache unchanged: %s\n", w->rank,
               text, l, kvmix_result_string((kvmix_result)r), same ? "yes" : "NO");
        ok = r != KVMIX_ERR_CUDA;
    }
    cudaFree(d_payload);
    return ok;
}

/* The next text from its prefill rank into a new running sequence; its rows stay staged. */
bool receive_text(worker *w, std::vector<running> &live, int32_t text, __half *sk, __half *sv) {
    const llama_config *c = config_of(w);
    running r = {};
    pd_frame f;
    r.text = text, r.peer = pd_text_prefill_rank(&w->layout, text);
    if (!recv_frame(w, r.peer, UINT64_MAX, &f)) return false;
    if (f.kind != PD_FRAME_SEQUENCE || f.text != text || f.n_layers != c->n_layers ||
        f.n_tokens < 1 || f.n_tokens > (int32_t)w->run->prompts[(size_t)text].size())
        return fail(w->err, sizeof w->err, "text %d: an unexpected sequence frame", text);
    r.n_prompt = f.n_tokens;
    r.tokens.push_back(f.first_token);
    if (!receive_layers(w, live, text, r.peer, r.n_prompt, KVMIX_PAYLOAD_ROWS, sk, sv, &r.tiers))
        return false;
    LLAMA_OK_(gpu_llama_seq_start(w->g, &r.seq, w->err, sizeof w->err));
    LLAMA_OK_(gpu_llama_rows_ingest_device(w->g, r.seq, r.n_prompt, sk, sv, w->err, sizeof w->err));
    live.push_back(r);
    return true;
}

/* The running sequence moved onto rows whose prompt part is the staged (upgraded) rows. */
bool reingest(worker *w, running *r, const __half *sk, const __half *sv) {
    const llama_config *c = config_of(w);
    int32_t n_pos = r->n_prompt + r->steps, next = -1;
    size_t row = row_halves(c), all = (size_t)c->n_layers * n_pos * row;
    __half *ak = halves(all), *av = halves(all);
    bool ok = ak && av &&
              gpu_llama_rows_read_device(w->g, r->seq, ak, av, w->err, sizeof w->err) == LLAMA_OK;
    size_t pitch = (size_t)n_pos * row * sizeof(__half), width = (size_t)r->n_prompt * row * 2;
    ok = ok &&
         cudaMemcpy2D(ak, pitch, sk, width, width, (size_t)c->n_layers, cudaMemcpyDeviceToDevice) ==
             cudaSuccess &&
         cudaMemcpy2D(av, pitch, sv, width, width, (size_t)c->n_layers, cudaMemcpyDeviceToDevice) ==
             cudaSuccess;
    if (ok) gpu_llama_seq_end(w->g, r->seq);
    ok = ok && gpu_llama_seq_start(w->g, &next, w->err, sizeof w->err) == LLAMA_OK &&
         gpu_llama_rows_ingest_device(w->g, next, n_pos, ak, av, w->err, sizeof w->err) == LLAMA_OK;
    if (ok) r->seq = next;
    cudaFree(ak), cudaFree(av);
    return ok || (w->err[0] ? false : fail(w->err, sizeof w->err, "moving a sequence failed"));
}

/* Asks for the residuals of the sequence's INT4 tokens and applies them. */
bool upgrade(worker *w, const std::vector<running> &live, running *r, __half *sk, __half *sv) {
    std::vector<int32_t> asked;
    for (int32_t j = 0; j < r->n_prompt; j++)
        if (r->tiers[(size_t)j] == KVMIX_FORMAT_INT4) asked.push_back(j);
    pd_frame ask = {PD_FRAME_ASK, r->text, 0, 0, (int32_t)asked.size(), 0, 0};
    r->upgraded = true;
    if (!send_frame(w, &ask, r->peer, w->send)) return false;
    if (asked.empty()) return true;
    int32_t *d_asked = NULL;
    CUDA_OK(cudaMalloc(&d_asked, asked.size() * sizeof(int32_t)), "asked positions");
    bool ok =
        cudaMemcpy(d_asked, asked.data(), asked.size() * sizeof(int32_t), cudaMemcpyHostToDevice) ==
            cudaSuccess &&
        ncclSend(d_asked, asked.size(), ncclInt32, r->peer, w->comm, w->send) == ncclSuccess &&
        cudaStreamSynchronize(w->send) == cudaSuccess;
    cudaFree(d_asked);
    double start = now();
    ok = ok &&
         receive_layers(w, live, r->text, r->peer, r->n_prompt, KVMIX_PAYLOAD_RESIDUAL, sk, sv,
                        NULL) &&
         reingest(w, r, sk, sv);
    if (ok)
        printf("decode %d: text %d: %zu cold tokens upgraded after %d steps (%.2f ms)\n", w->rank,
               r->text, asked.size(), r->steps, 1e3 * (now() - start));
    return ok || (w->err[0] ? false : fail(w->err, sizeof w->err, "the upgrade failed"));
}

/* One token of every running sequence. */
bool step_all(worker *w, std::vector<running> &live) {
    const llama_config *c = config_of(w);
    std::vector<int32_t> seqs, tokens;
    for (const running &r : live) seqs.push_back(r.seq), tokens.push_back(r.tokens.back());
    std::vector<float> logits(live.size() * (size_t)c->vocab);
    LLAMA_OK_(gpu_llama_step(w->g, seqs.data(), tokens.data(), (int32_t)live.size(), logits.data(),
                             w->err, sizeof w->err));
    for (size_t i = 0; i < live.size(); i++) {
        live[i].tokens.push_back(llama_argmax(logits.data() + i * c->vocab, c->vocab));
        live[i].steps++;
    }
    return true;
}

/* A finished sequence's tokens against the reference (when there is one). */
void finish(worker *w, const running &r) {
    const std::vector<int32_t> &want = w->run->expected[(size_t)r.text];
    gpu_llama_seq_end(w->g, r.seq);
    if (want.empty()) {
        printf("decode %d: text %d: %zu tokens (no reference)\n", w->rank, r.text, r.tokens.size());
        return;
    }
    int32_t first = -1, n = (int32_t)r.tokens.size();
    int32_t same = want.size() == r.tokens.size()
                       ? pd_tokens_same(want.data(), r.tokens.data(), n, &first)
                       : 0;
    w->same += same, w->compared += n;
    printf("decode %d: text %d: %d of %d tokens as the single-GPU run (first difference %d)\n",
           w->rank, r.text, same, n, first);
}

bool run_decode(worker *w) {
    const options *o = w->run->o;
    const llama_config *c = config_of(w);
    std::vector<int32_t> mine((size_t)o->texts);
    int32_t n_mine = pd_rank_texts(&w->layout, w->rank, o->texts, mine.data()), next = 0;
    size_t all = (size_t)c->n_layers * o->prompt_tokens * row_halves(c);
    __half *sk = halves(all), *sv = halves(all); /* the staged rows of the sequence to upgrade */
    std::vector<running> live;
    int32_t pending = -1; /* the text whose residuals are still to be asked */
    bool ok = sk && sv ? true : fail(w->err, sizeof w->err, "staging: out of memory");
    while (ok && (next < n_mine || !live.empty())) {
        /* one prefill rank answers one ask at a time: a new text only once it was asked */
        if (pending < 0 && next < n_mine) {
            pending = mine[(size_t)next++];
            ok = receive_text(w, live, pending, sk, sv);
        }
        if (ok && !live.empty()) ok = step_all(w, live);
        for (running &r : live)
            if (ok && r.text == pending &&
                (r.steps >= o->upgrade_after || (int32_t)r.tokens.size() >= o->generate)) {
                ok = upgrade(w, live, &r, sk, sv);
                pending = -1;
            }
        for (size_t i = 0; ok && i < live.size();) {
            if ((int32_t)live[i].tokens.size() < o->generate || !live[i].upgraded) {
                i++;
                continue;
            }
            live[i].tokens.resize((size_t)o->generate);
            finish(w, live[i]);
            live.erase(live.begin() + (long)i);
        }
    }
    cudaFree(sk), cudaFree(sv);
    return ok;
}

/* ---- the single-GPU reference -------------------------------------------------------------- */

/* Every text prefilled and decoded greedily on one GPU, batched; "TEXT: tokens" lines to path. */
bool run_reference(worker *w, const char *path) {
    const options *o = w->run->o;
    const llama_config *c = config_of(w);
    std::vector<running> live((size_t)o->texts);
    for (int32_t t = 0; t < o->texts; t++) {
        running &r = live[(size_t)t];
        const std::vector<int32_t> &ids = w->run->prompts[(size_t)t];
        std::vector<float> logits(ids.size() * (size_t)c->vocab);
        r.text = t, r.upgraded = true;
        LLAMA_OK_(gpu_llama_seq_start(w->g, &r.seq, w->err, sizeof w->err));
        LLAMA_OK_(gpu_llama_prefill(w->g, r.seq, ids.data(), (int32_t)ids.size(), logits.data(),
                                    w->err, sizeof w->err));
        r.tokens.push_back(llama_argmax(logits.data() + (ids.size() - 1) * c->vocab, c->vocab));
    }
    while (!live.empty() && (int32_t)live[0].tokens.size() < o->generate)
        if (!step_all(w, live)) return false;
    FILE *f = fopen(path, "w");
    if (!f) return fail(w->err, sizeof w->err, "%s: cannot write", path);
    for (const running &r : live) {
        fprintf(f, "%d:", r.text);
        for (int32_t i = 0; i < o->generate; i++) fprintf(f, " %d", r.tokens[(size_t)i]);
        fprintf(f, "\n");
    }
    printf("reference: %d texts, %d tokens each, on %s -> %s\n", o->texts, o->generate,
           gpu_llama_device_name(w->g), path);
    return fclose(f) == 0 || fail(w->err, sizeof w->err, "%s: cannot write", path);
}

/* ---- the measurement (two ranks) ----------------------------------------------------------- */

const double BENCH_BUDGETS[] = {1.0, 0.5, 0.3};
enum { N_BENCH = 3 };

/* n_layers plain sends of `bytes` each (no frames, no packing), timed like the payloads'. */
bool plain_sends(worker *w, uint64_t bytes, int32_t peer, bool sender, double *out_seconds) {
    const llama_config *c = config_of(w);
    uint8_t *buf = NULL;
    cudaEvent_t a, b;
    CUDA_OK(cudaMalloc(&buf, bytes), "plain buffer");
    CUDA_OK(cudaEventCreate(&a), "events");
    CUDA_OK(cudaEventCreate(&b), "events");
    bool ok = true;
    *out_seconds = 0.0;
    for (int32_t l = 0; ok && l < c->n_layers; l++) {
        float ms = 0.0f;
        ok = cudaEventRecord(a, w->send) == cudaSuccess &&
             (sender ? ncclSend(buf, bytes, ncclUint8, peer, w->comm, w->send)
                     : ncclRecv(buf, bytes, ncclUint8, peer, w->comm, w->send)) == ncclSuccess &&
             cudaEventRecord(b, w->send) == cudaSuccess && cudaEventSynchronize(b) == cudaSuccess &&
             cudaEventElapsedTime(&ms, a, b) == cudaSuccess;
        *out_seconds += 1e-3 * ms;
    }
    cudaFree(buf), cudaEventDestroy(a), cudaEventDestroy(b);
    return ok || fail(w->err, sizeof w->err, "plain sends failed");
}

/* The decode side of one timed payload transfer: frames read, payloads taken (no unpack). */
bool bench_receive(worker *w, int32_t peer, uint64_t *out_bytes) {
    pd_frame seq, f;
    uint8_t *buf = NULL;
    if (!recv_frame(w, peer, UINT64_MAX, &seq)) return false;
    *out_bytes = seq.payload_bytes;
    CUDA_OK(cudaMalloc(&buf, seq.payload_bytes), "payload buffer");
    bool ok = true;
    for (int32_t l = 0; ok && l < seq.n_layers; l++)
        ok = recv_frame(w, peer, seq.payload_bytes, &f) &&
             ncclRecv(buf, f.payload_bytes, ncclUint8, peer, w->comm, w->send) == ncclSuccess;
    ok = ok && cudaStreamSynchronize(w->send) == cudaSuccess;
    cudaFree(buf);
    return ok || (w->err[0] ? false : fail(w->err, sizeof w->err, "receiving failed"));
}

/* Time to the first decoded token of text 0 at budget 0.5, with or without the overlap: both
   ranks start at a barrier; the prefill rank prefills and sends, the decode rank receives,
   ingests and steps once. Seconds on the decode rank. */
bool bench_ttft(worker *w, bool overlap, double *out_seconds) {
    bool prefill = pd_rank_role(&w->layout, w->rank) == PD_PREFILL;
    pthread_barrier_wait(&w->run->barrier);
    double start = now();
    if (prefill) {
        prefilled s = {};
        bool ok = prefill_rows(w, 0, &s) && choose_tiers(w, &s, 0.5) &&
                  send_sequence(w, &s, 1, overlap, false, NULL, NULL) && serve_residuals(w, &s, 1);
        prefilled_free(&s);
        return ok;
    }
    const llama_config *c = config_of(w);
    size_t all = (size_t)c->n_layers * w->run->o->prompt_tokens * row_halves(c);
    __half *sk = halves(all), *sv = halves(all);
    std::vector<running> live;
    bool ok = sk && sv && receive_text(w, live, 0, sk, sv) && step_all(w, live);
    *out_seconds = now() - start;
    if (ok) live[0].tiers.assign(live[0].tiers.size(), KVMIX_FORMAT_FP16); /* ask nothing */
    ok = ok && upgrade(w, live, &live[0], sk, sv);
    if (ok) gpu_llama_seq_end(w->g, live[0].seq);
    cudaFree(sk), cudaFree(sv);
    return ok || (w->err[0] ? false : fail(w->err, sizeof w->err, "the timed text failed"));
}

void print_row(const char *name, uint64_t bytes, int32_t n_layers, double seconds, double plain) {
    double gbps = (double)bytes * n_layers / seconds / 1e9;
    printf("| %-22s | %10llu | %8.4f | %7.2f | %5.2f |\n", name, (unsigned long long)bytes,
           1e3 * seconds / n_layers, gbps, plain / seconds);
}

bool run_bench(worker *w) {
    const options *o = w->run->o;
    int32_t n_layers = config_of(w)->n_layers, peer = 1 - w->rank;
    bool sender = w->rank == 0, ok = true;
    prefilled s = {};
    double ttft[2] = {0.0, 0.0};
    if (sender) ok = prefill_rows(w, 0, &s);
    if (sender && ok)
        printf("bench: %s, %d prompt tokens, %d layers, %d repeats, %s\n",
               gpu_llama_device_name(w->g), s.n, n_layers, o->repeat, "frames included");
    if (sender && ok)
        printf("| %-22s | %10s | %8s | %7s | %5s |\n|---|---|---|---|---|\n", "configuration",
               "bytes/layer", "ms/layer", "GB/s", "x plain");
    for (int b = 0; ok && b < N_BENCH; b++) {
        double payload = 0.0, plain = 0.0;
        uint64_t bytes = 0;
        if (sender) ok = choose_tiers(w, &s, BENCH_BUDGETS[b]);
        for (int32_t r = -1; ok && r < o->repeat; r++) { /* r = -1: a warm-up, not timed */
            double t = 0.0, p = 0.0;
            if (sender)
                ok = send_sequence(w, &s, peer, true, false, &t, &bytes) &&
                     plain_sends(w, bytes, peer, true, &p);
            else
                ok = bench_receive(w, peer, &bytes) && plain_sends(w, bytes, peer, false, &p);
            if (r >= 0) payload += t, plain += p;
        }
        if (sender && ok) {
            char name[64];
            snprintf(name, sizeof name, "plain ncclSend, b=%.1f", BENCH_BUDGETS[b]);
            print_row(name, bytes, n_layers, plain / o->repeat, plain / o->repeat);
            snprintf(name, sizeof name, b == 0 ? "FP16 payload, b=1" : "tiered payload, b=%.1f",
                     BENCH_BUDGETS[b]);
            print_row(name, bytes, n_layers, payload / o->repeat, plain / o->repeat);
        }
    }
    prefilled_free(&s);
    for (int i = 0; ok && i < 2; i++) ok = bench_ttft(w, i == 0, &ttft[i]);
    if (ok && !sender)
        printf("bench: time to first decoded token at b=0.5: %.2f ms with the overlap, %.2f ms "
               "without (ratio %.3f)\n",
               1e3 * ttft[0], 1e3 * ttft[1], ttft[0] / ttft[1]);
    return ok;
}

/* ---- ranks, options, the program ----------------------------------------------------------- */

/* The rank's device, streams, communicator and runner. */
bool worker_init(worker *w, bool with_nccl) {
    const options *o = w->run->o;
    const llama_config *c = config_of(w);
    int32_t max_seqs = o->bench ? 2 : o->texts + 1; /* + 1: a sequence moved onto upgraded rows */
    int32_t max_tokens = o->prompt_tokens + o->generate + o->upgrade_after + 2;
    CUDA_OK(cudaSetDevice(w->rank), "selecting the device");
    CUDA_OK(cudaStreamCreateWithFlags(&w->pack, cudaStreamNonBlocking), "streams");
    CUDA_OK(cudaStreamCreateWithFlags(&w->send, cudaStreamNonBlocking), "streams");
    CUDA_OK(cudaMalloc(&w->d_flags, sizeof(int32_t)), "flags");
    CUDA_OK(cudaMemset(w->d_flags, 0, sizeof(int32_t)), "flags");
    CUDA_OK(cudaMalloc(&w->d_frame, PD_FRAME_BYTES), "frames");
    KVMIX_OK(kvmix_cuda_payload_workspace_bytes(max_tokens, &w->work_bytes), "workspace");
    CUDA_OK(cudaMalloc(&w->work, w->work_bytes), "workspace");
    if (with_nccl)
        NCCL_OK(ncclCommInitRank(&w->comm, o->ranks, w->run->id, w->rank), "ncclCommInitRank");
    LLAMA_OK_(gpu_llama_create(w->run->model, kvmix_kv_policy_builtin("fp16"), max_seqs, max_tokens,
                               0, &w->g, w->err, sizeof w->err));
    LLAMA_OK_(gpu_llama_batch_invariant(w->g, true, w->err, sizeof w->err));
    return true;
}

void worker_free(worker *w) {
    if (w->g) gpu_llama_free(w->g);
    if (w->comm) ncclCommDestroy(w->comm);
    cudaFree(w->d_flags), cudaFree(w->d_frame), cudaFree(w->work);
    if (w->pack) cudaStreamDestroy(w->pack);
    if (w->send) cudaStreamDestroy(w->send);
}

void *rank_main(void *arg) {
    worker *w = (worker *)arg;
    const options *o = w->run->o;
    bool ok = worker_init(w, true);
    if (ok && o->bench)
        ok = run_bench(w);
    else if (ok)
        ok = pd_rank_role(&w->layout, w->rank) == PD_PREFILL ? run_prefill(w) : run_decode(w);
    if (!ok) fprintf(stderr, "rank %d: %s\n", w->rank, w->err[0] ? w->err : "failed");
    w->rc = ok ? 0 : 1;
    worker_free(w);
    return NULL;
}

/* Text `index` of the data file as ids: <|endoftext|>, then its tokens, at most max. */
bool prompt_ids(const options *o, const llama_model *m, int32_t index, std::vector<int32_t> *out) {
    size_t bytes = 0;
    char *data = llama_read_text(o->data, &bytes), *line = data;
    for (int32_t i = 0; line && i < index; i++)
        line = (line = strchr(line, '\n')) ? line + 1 : NULL;
    const char *end = line ? strchr(line, '\n') : NULL;
    size_t n_line = line ? (end ? (size_t)(end - line) : strlen(line)) : 0;
    cJSON *doc = line ? cJSON_ParseWithLengthOpts(line, n_line, NULL, 0) : NULL;
    const cJSON *text = cJSON_GetObjectItemCaseSensitive(doc, "text");
    bool ok = false;
    if (cJSON_IsString(text)) {
        size_t n_text = strlen(text->valuestring);
        std::vector<int32_t> ids(n_text + 1);
        int64_t n = 0;
        ok = llama_tokenize(&m->tokenizer, text->valuestring, n_text, ids.data() + 1, &n) ==
             LLAMA_OK;
        ids[0] = llama_special_id(&m->tokenizer, "<|endoftext|>");
        ids.resize((size_t)(n + 1 < o->prompt_tokens ? n + 1 : o->prompt_tokens));
        *out = ids;
    }
    cJSON_Delete(doc);
    free(data);
    return ok && out->size() >= 2;
}

bool load_expected(const char *path, shared_run *run) {
    size_t bytes = 0;
    char *data = llama_read_text(path, &bytes);
    int32_t loaded = 0;
    for (char *line = data; line && *line;) {
        char *end = strchr(line, '\n');
        if (end) *end = '\0';
        int32_t text = -1, n = 0;
        std::vector<int32_t> tokens((size_t)run->o->generate);
        if (pd_tokens_parse(line, &text, tokens.data(), run->o->generate, &n) != KVMIX_SUCCESS ||
            text >= run->o->texts || n != run->o->generate)
            break;
        run->expected[(size_t)text] = tokens, loaded++;
        line = end ? end + 1 : NULL;
    }
    free(data);
    return loaded == run->o->texts;
}

bool parse_options(int argc, char **argv, options *o) {
    *o = options{NULL, NULL, NULL,        NULL, 0,   1,   4,    256,  32,
                 4,    5,    INJECT_NONE, 0,    1.0, 1.0, true, false};
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        char *end = NULL;
        if (strcmp(a, "--no-overlap") == 0)
            o->overlap = false;
        else if (strcmp(a, "--bench") == 0)
            o->bench = true;
        else if (!v)
            return false;
        else if (strcmp(a, "--model") == 0)
            o->model = v, i++;
        else if (strcmp(a, "--data") == 0)
            o->data = v, i++;
        else if (strcmp(a, "--expect") == 0)
            o->expect = v, i++;
        else if (strcmp(a, "--reference") == 0)
            o->reference = v, i++;
        else if (strcmp(a, "--inject") == 0) {
            o->inject = strcmp(v, "truncate") == 0  ? INJECT_TRUNCATE
                        : strcmp(v, "corrupt") == 0 ? INJECT_CORRUPT
                                                    : -1;
            i++;
        } else if (strcmp(a, "--budget") == 0)
            o->budget = strtod(v, &end), i++;
        else if (strcmp(a, "--min-agreement") == 0)
            o->min_agreement = strtod(v, &end), i++;
        else {
            int32_t *field = strcmp(a, "--ranks") == 0           ? &o->ranks
                             : strcmp(a, "--prefill") == 0       ? &o->prefill
                             : strcmp(a, "--texts") == 0         ? &o->texts
                             : strcmp(a, "--prompt-tokens") == 0 ? &o->prompt_tokens
                             : strcmp(a, "--generate") == 0      ? &o->generate
                             : strcmp(a, "--upgrade-after") == 0 ? &o->upgrade_after
                             : strcmp(a, "--repeat") == 0        ? &o->repeat
                             : strcmp(a, "--group-size") == 0    ? &o->group_size
                                                                 : NULL;
            if (!field) return false;
            *field = (int32_t)strtol(v, &end, 10), i++;
        }
        if (end && *end) return false;
    }
    return o->model && o->data && o->inject >= 0 && o->texts >= 1 && o->texts <= 4096 &&
           o->prompt_tokens >= 2 && o->generate >= 1 && o->upgrade_after >= 0 && o->repeat >= 1 &&
           o->budget > 0.0 && o->budget <= 1.0 && o->ranks >= 0 && o->group_size >= 0;
}

/* Whether the tiers of an n-token text at `budget` send every token (its sinks FP16, the rest at
   least INT4): below that kvmix_tier_choose would leave tokens out, which this program does not
   do (a ROWS payload carries every position of its range), so such a budget is refused before
   any rank starts rather than by one rank while the other waits for its payloads. */
bool budget_sends_every_token(const options *o, const llama_config *c, int32_t n, double budget) {
    kvmix_tier_desc d = {n, c->head_dim, o->group_size, N_SINKS < n ? N_SINKS : n, budget, 1, 0};
    std::vector<float> importance((size_t)n, 1.0f);
    std::vector<uint8_t> tiers((size_t)n);
    kvmix_tier_plan plan;
    return kvmix_tier_choose(&d, importance.data(), tiers.data(), &plan, NULL) == KVMIX_SUCCESS &&
           plan.n_dropped == 0;
}

/* The first text whose tokens the run's budgets cannot all send, or -1. */
int32_t text_over_budget(const options *o, const shared_run *run, double *out_budget) {
    const double *budgets = o->bench ? BENCH_BUDGETS : &o->budget;
    int32_t n_budgets = o->bench ? N_BENCH : 1;
    for (int32_t t = 0; t < o->texts; t++)
        for (int32_t b = 0; b < n_budgets; b++)
            if (!budget_sends_every_token(o, &run->model->config,
                                          (int32_t)run->prompts[(size_t)t].size(), budgets[b])) {
                *out_budget = budgets[b];
                return t;
            }
    return -1;
}

} // namespace

int main(int argc, char **argv) {
    options o;
    llama_model model;
    char err[256];
    if (!parse_options(argc, argv, &o)) {
        fprintf(
            stderr,
            "usage: pd_nccl --model M --data D [--ranks N] [--prefill P] [--texts K]\n"
            "               [--prompt-tokens N] [--generate G] [--budget B] [--upgrade-after U]\n"
            "               [--expect FILE] [--min-agreement A] [--inject truncate|corrupt]\n"
            "               [--no-overlap] [--group-size G]\n"
            "       pd_nccl --reference FILE --model M --data D [--texts K] ...\n"
            "       pd_nccl --bench --model M --data D [--prompt-tokens N] [--repeat R]\n"
            "               [--group-size G]\n");
        return 2;
    }
    setvbuf(stdout, NULL, _IOLBF, 0);
    /* NVLink multicast (NVLS) stays off: it needs fabric-managed memory this program never asks
       for, and the p2p sends here gain nothing from it */
    setenv("NCCL_NVLS_ENABLE", "0", 1);
    int devices = 0;
    if (cudaGetDeviceCount(&devices) != cudaSuccess || devices < 1) {
        fprintf(stderr, "pd_nccl: no CUDA device\n");
        return 1;
    }
    if (o.ranks == 0) o.ranks = o.bench ? 2 : devices;
    if (o.bench) o.texts = 1, o.prefill = 1;
    pd_layout layout = {o.ranks, o.prefill};
    if (!o.reference && (pd_layout_check(&layout, err, sizeof err) != KVMIX_SUCCESS ||
                         o.ranks > devices || (o.bench && o.ranks != 2))) {
        fprintf(stderr, "pd_nccl: %s\n",
                o.ranks > devices ? "more ranks than devices"
                : o.bench         ? "--bench takes 2 ranks"
                                  : err);
        return 1;
    }
    if (llama_model_load(o.model, &model, err, sizeof err) != LLAMA_OK) {
        fprintf(stderr, "pd_nccl: %s: %s\n", o.model, err);
        return 1;
    }
    shared_run run;
    run.o = &o, run.model = &model;
    run.prompts.resize((size_t)o.texts), run.expected.resize((size_t)o.texts);
    bool ok = true;
    for (int32_t t = 0; ok && t < o.texts; t++)
        ok = prompt_ids(&o, &model, t, &run.prompts[(size_t)t]);
    if (!ok) fprintf(stderr, "pd_nccl: %s has fewer than %d texts\n", o.data, o.texts);
    if (ok && o.expect && !(ok = load_expected(o.expect, &run)))
        fprintf(stderr, "pd_nccl: %s: not %d lines of %d tokens\n", o.expect, o.texts, o.generate);
    double over = 0.0;
    int32_t text = ok ? text_over_budget(&o, &run, &over) : -1;
    if (text >= 0) {
        fprintf(stderr,
                "pd_nccl: budget %.2f cannot send every token of text %d (%zu tokens: %d FP16 "
                "sinks, the rest INT4 at group size %d take more); give a larger budget or "
                "--group-size\n",
                over, text, run.prompts[(size_t)text].size(), N_SINKS,
                o.group_size ? o.group_size : KVMIX_GROUP_SIZE_DEFAULT);
        ok = false;
    }
    if (!ok) {
        llama_model_free(&model);
        return 1;
    }
    std::vector<worker> ranks((size_t)(o.reference ? 1 : o.ranks));
    for (size_t r = 0; r < ranks.size(); r++) {
        ranks[r] = worker{};
        ranks[r].run = &run, ranks[r].rank = (int32_t)r, ranks[r].layout = layout;
    }
    if (o.reference) {
        worker *w = &ranks[0];
        ok = worker_init(w, false) && run_reference(w, o.reference);
        if (!ok) fprintf(stderr, "reference: %s\n", w->err);
        worker_free(w);
        llama_model_free(&model);
        return ok ? 0 : 1;
    }
    printf("pd_nccl: %s, %d ranks (%d prefill, %d decode), %d texts of up to %d tokens, %d to "
           "generate, budget %.2f, overlap %s\n",
           model.config.name, o.ranks, o.prefill, o.ranks - o.prefill, o.texts, o.prompt_tokens,
           o.generate, o.budget, o.overlap ? "on" : "off");
    pthread_barrier_init(&run.barrier, NULL, (unsigned)o.ranks);
    ok = ncclGetUniqueId(&run.id) == ncclSuccess;
    std::vector<pthread_t> threads(ranks.size());
    for (size_t r = 0; ok && r < ranks.size(); r++)
        ok = pthread_create(&threads[r], NULL, rank_main, &ranks[r]) == 0;
    int64_t same = 0, compared = 0, refused = 0, unchanged = 0;
    int rc = ok ? 0 : 1;
    for (size_t r = 0; ok && r < ranks.size(); r++) {
        pthread_join(threads[r], NULL);
        rc |= ranks[r].rc;
        same += ranks[r].same, compared += ranks[r].compared;
        refused += ranks[r].refused, unchanged += ranks[r].refused_unchanged;
    }
    pthread_barrier_destroy(&run.barrier);
    llama_model_free(&model);
    if (o.bench) return rc;
    double agreement = compared > 0 ? (double)same / (double)compared : 0.0;
    bool refusals_ok =
        o.inject == INJECT_NONE ? refused == 0 : refused >= 1 && unchanged == refused;
    if (o.expect)
        printf("pd_nccl: agreement with the single-GPU run at budget %.2f: %.4f (%lld of %lld "
               "tokens)\n",
               o.budget, agreement, (long long)same, (long long)compared);
    if (o.inject != INJECT_NONE)
        printf("pd_nccl: %lld broken payloads refused, cache unchanged for %lld\n",
               (long long)refused, (long long)unchanged);
    bool passed = rc == 0 && refusals_ok && (!o.expect || agreement >= o.min_agreement);
    printf("pd_nccl: %s\n", passed ? "ok" : "FAILED");
    return passed ? 0 : 1;
}

/* Compiles the header as the Makefile's language and mode (C99, C11, C++, KVMIX_STATIC): included
   twice, implementation and all, and a few calls so KVMIX_STATIC functions are referenced. */
#define KVMIX_IMPLEMENTATION
#include "../kvmix.h"
#include "../kvmix.h"

int main(void) {
    kvmix_layout layout;
    size_t bytes = 0;
    memset(&layout, 0, sizeof layout);
    layout.format = KVMIX_FORMAT_BOOSTED;
    layout.n_tokens = 64;
    layout.head_dim = 128;
    layout.n_boost = 16;
    if (kvmix_layout_bytes(&layout, &bytes) != KVMIX_SUCCESS || bytes == 0) return 1;
    if (kvmix_fp32_to_fp16(1.0f) != 0x3c00 || kvmix_fp32_to_bf16(1.0f) != 0x3f80) return 1;
    return kvmix_result_string(KVMIX_SUCCESS)[0] == 's' ? 0 : 1;
}

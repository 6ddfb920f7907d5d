/* tag_allocation.h - a bit allocation per template tag, as kvmix-calibrate writes it (the
 * "Allocation JSON" of examples/kvmix_calibrate.c, version 1), read into a kvmix_tag_precision
 * (kvmix.h, "Tag precision") that a policy stores tokens by.
 *
 * Only what a cache needs is read: "version", "kind" and, per entry of "tags", its "bucket",
 * "role", "modality", "key_format" and "value_format" (names as kvmix_tag_*_name and
 * kvmix_format_name spell them); the other fields are the tool's report. Tags the allocation does
 * not list keep the fallback formats. Pure and thread-safe; links with one kvmix implementation.
 */
#ifndef KVMIX_TAG_ALLOCATION_H
#define KVMIX_TAG_ALLOCATION_H
#include <stddef.h>
#include "kvmix.h"

/* Parses a document of json_bytes (need not be NUL-terminated) into *out (written only on
 * success). Returns KVMIX_SUCCESS, KVMIX_ERR_NULL_POINTER, KVMIX_ERR_MALFORMED (malformed JSON, a
 * missing or unknown name; the message says which tag and field), KVMIX_ERR_VERSION, or
 * KVMIX_ERR_UNKNOWN_FORMAT (fallback). err (may be NULL) receives a message on error. */
kvmix_result tag_allocation_parse(const char *json, size_t json_bytes,
                                  kvmix_cache_precision fallback, kvmix_tag_precision *out,
                                  char *err, size_t err_bytes);

/* Reads (tag_spec_read_file: at most 16 MiB) and parses the file at path; KVMIX_ERR_NOT_FOUND
 * when it cannot be opened. */
kvmix_result tag_allocation_load(const char *path, kvmix_cache_precision fallback,
                                 kvmix_tag_precision *out, char *err, size_t err_bytes);

/* What an allocation prices each tag's tokens at (the "bits" of its entries in "tags": bits per
 * element that sealed pages hold, runs' closed pages included when kvmix-calibrate priced by
 * runs); 0 for a tag the allocation does not list. */
typedef struct tag_prices {
    double bits[KVMIX_TAG_N_BUCKETS][KVMIX_TAG_N_ROLES][KVMIX_TAG_N_MODALITIES];
} tag_prices;
/* Reads the prices of an allocation document that tag_allocation_parse accepts; a listed tag's
 * "bits" must be a number in (0, 65536]. Returns as tag_allocation_parse (KVMIX_ERR_MALFORMED for
 * a missing or bad "bits"). */
kvmix_result tag_allocation_prices_parse(const char *json, size_t json_bytes, tag_prices *out,
                                         char *err, size_t err_bytes);
/* The same from a file (as tag_allocation_load). */
kvmix_result tag_allocation_prices_load(const char *path, tag_prices *out, char *err,
                                        size_t err_bytes);
#endif /* KVMIX_TAG_ALLOCATION_H */

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

#endif /* KVMIX_TAG_ALLOCATION_H */

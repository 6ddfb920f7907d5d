/* tag_spec_json.h - the JSON form of a kvmix template spec (kvmix_tag_spec, kvmix.h "Template
 * tags"), for the tools in examples/: kvmix-tag reads it, kvmix-tagspec writes it.
 *
 * A document is one JSON object, version 1, 2 or 3; README.md ("Template tags") has the schema
 * table:
 *
 *   {"version": 1, "name": "qwen3", "description": "...",
 *    "message_start": [[151644]], "message_end": [[151645]], "header_end": [[198]],
 *    "channel": [], "reasoning_open": [[151667]], ..., "image_pad": [[151655]],
 *    "roles": [{"name": "system", "role": "instruction", "ids": [8948]}, ...],
 *    "channels": [{"name": "analysis", "role": "reasoning", "ids": [35644]}, ...]}
 *
 * Version 2 adds the optional "recipient" marker after "channel" (harmony's " to=": an assistant
 * message whose header holds it is a tool call); version 1 has no other difference and still
 * loads. Version 3 adds the optional "role_starts" after "channels" (entries as in "roles":
 * special tokens that start a headless message of their role, DeepSeek V3's <｜User｜>). The
 * writer writes the lowest version that holds the spec (1 without a recipient marker or role
 * starts, 2 without role starts), so that older readers read what they can.
 *
 * Every marker is a list of alternative id sequences. The reader is strict: unknown or repeated
 * fields, wrong types, ids out of range and too many entries are errors whose message names the
 * field, and the spec must pass kvmix_tag_spec_check. Functions are pure and thread-safe (cJSON is
 * used without its global hooks or error pointer). tag_spec_json.c compiles the kvmix
 * implementation: link it once, and not with another file that does (examples/llama.c), unless
 * it is built with -DTAG_SPEC_JSON_NO_KVMIX_IMPLEMENTATION (as kvmix-calibrate is).
 */
#ifndef KVMIX_TAG_SPEC_JSON_H
#define KVMIX_TAG_SPEC_JSON_H

#include <stddef.h>

#include "kvmix.h"

#define TAG_SPEC_VERSION 3 /* the newest version read; 1 and 2 still load */

#if defined(__GNUC__)
#define TAG_SPEC_PRINTF_LIKE(fmt, args) __attribute__((format(printf, fmt, args)))
#else
#define TAG_SPEC_PRINTF_LIKE(fmt, args)
#endif

/* Writes a printf-style message into err (err_bytes, may be NULL/0) and returns r: how the tag
 * tools (this reader, hf_tokenizer.c) report what went wrong. */
kvmix_result tag_spec_fail(char *err, size_t err_bytes, kvmix_result r, const char *fmt, ...)
    TAG_SPEC_PRINTF_LIKE(4, 5);

typedef struct tag_spec_doc {
    char name[64];         /* 1-63 bytes */
    char description[256]; /* 0-255 bytes */
    kvmix_tag_spec spec;
} tag_spec_doc;

/* Parses a document of json_bytes (need not be NUL-terminated) into *out (written only on
 * success). Returns KVMIX_SUCCESS, KVMIX_ERR_NULL_POINTER, KVMIX_ERR_MALFORMED (malformed JSON, a
 * field of the wrong type or range, unknown or repeated fields; the message names the field),
 * KVMIX_ERR_VERSION or KVMIX_ERR_INVALID_ARGUMENT (kvmix_tag_spec_check refused the spec). err
 * (may be NULL) receives a NUL-terminated message on error. */
kvmix_result tag_spec_parse(const char *json, size_t json_bytes, tag_spec_doc *out, char *err,
                            size_t err_bytes);

/* The whole file at path (malloc'd, at most 16 MiB; free() it), its size in *n_bytes: how the tag
 * tools read their documents. NULL with *why KVMIX_ERR_NOT_FOUND (it cannot be opened) or
 * KVMIX_ERR_OUT_OF_MEMORY (too large). */
char *tag_spec_read_file(const char *path, size_t *n_bytes, kvmix_result *why);

/* Reads and parses the file at path; KVMIX_ERR_NOT_FOUND when it cannot be read. */
kvmix_result tag_spec_load(const char *path, tag_spec_doc *out, char *err, size_t err_bytes);

/* The document as JSON text (one field a line, one role or channel a line, a final newline),
 * malloc'd and NUL-terminated; NULL when out of memory. The same doc always gives the same bytes,
 * and the text parses back to an equal doc. */
char *tag_spec_json(const tag_spec_doc *doc);

/* Nonzero when two docs say the same (names, description, every used id). */
int tag_spec_equal(const tag_spec_doc *a, const tag_spec_doc *b);

#endif

/* hf_tokenizer.h - just enough of a Hugging Face byte-level BPE tokenizer (tokenizer.json, with an
 * optional tokenizer_config.json) for the template-tag tools: special-token ids by name, BPE
 * encoding of text through "model.vocab" and "model.merges" (GPT-2 byte-to-unicode table, merges
 * applied by rank), decoding of ids to bytes, and the template spec of a ChatML or harmony
 * tokenizer (kvmix-tagspec).
 *
 * The pre-tokenizer is an ASCII reading of the Qwen2/cl100k-style split regex (contractions,
 * letters with one leading non-letter, digits in runs of 1 or 3, punctuation runs, newlines,
 * spaces); bytes >= 0x80 count as letters. It is exact for single words such as role and channel
 * names, and gives valid (if not always canonical) ids for other text. Special tokens (every entry
 * of "added_tokens") are matched first, longest first.
 *
 * A tokenizer is immutable after loading: encode/decode are thread-safe on it.
 */
#ifndef KVMIX_HF_TOKENIZER_H
#define KVMIX_HF_TOKENIZER_H

#include <stddef.h>
#include <stdint.h>

#include "kvmix.h"
#include "tag_spec_json.h"

typedef struct hf_tokenizer hf_tokenizer;

/* Loads tokenizer.json (a path ending in ".gz" is read through `gzip -dc`) and, when config_path
 * is not NULL, tokenizer_config.json's "added_tokens_decoder" (which must agree with the ids of
 * tokenizer.json). Returns KVMIX_ERR_NOT_FOUND (cannot read), KVMIX_ERR_MALFORMED (not a byte-level
 * BPE tokenizer.json), KVMIX_ERR_OUT_OF_MEMORY; err (may be NULL) receives a message. */
kvmix_result hf_tokenizer_load(const char *tokenizer_path, const char *config_path,
                               hf_tokenizer **out, char *err, size_t err_bytes);
void hf_tokenizer_free(hf_tokenizer *tok);

/* The id of an added token by its content ("<|im_start|>"), or -1. */
int32_t hf_tokenizer_special(const hf_tokenizer *tok, const char *content);

/* The id of one vocabulary entry given as raw bytes (mapped through the byte table), or -1. */
int32_t hf_tokenizer_vocab_id(const hf_tokenizer *tok, const char *bytes, size_t n_bytes);

/* Encodes text [n_bytes] into ids [cap]; *out_n receives the count. Returns
 * KVMIX_ERR_BUFFER_TOO_SMALL when cap is too small, KVMIX_ERR_NOT_FOUND when a piece has no
 * vocabulary entry (a tokenizer without every byte), KVMIX_ERR_NULL_POINTER. */
kvmix_result hf_tokenizer_encode(const hf_tokenizer *tok, const char *text, size_t n_bytes,
                                 int32_t *ids, int32_t cap, int32_t *out_n);

/* The bytes of one id into out [cap] (not NUL-terminated); returns the byte count, or -1 for an
 * id the tokenizer does not have or a cap too small. */
int32_t hf_tokenizer_decode(const hf_tokenizer *tok, int32_t id, char *out, size_t cap);

/* The template spec of a tokenizer: template "chatml" (<|im_start|> ROLE \n ... <|im_end|>; the
 * header also ends at a "\n\n" token, which content that starts with a newline makes; with
 * <think>, <tool_call>, <tool_response>, vision and image/video pads when the tokenizer has them)
 * or "harmony" (<|start|> ROLE [ to=RECIPIENT] [<|channel|> NAME [ to=RECIPIENT]] <|message|>
 * ... <|end|> / <|call|> / <|return|>; " to=" is the recipient marker: analysis is reasoning,
 * commentary and final are assistant text, a message to a recipient is a tool call), or NULL to
 * choose by the special tokens present. Role and channel names and " to=" are encoded through
 * the vocabulary (several ids when BPE gives several). A NULL description gives
 * "TEMPLATE template; written by kvmix-tagspec from a tokenizer.json". Returns KVMIX_ERR_NOT_FOUND
 * (a required special token is missing), KVMIX_ERR_INVALID_ARGUMENT (unknown template), or a
 * spec check error. */
kvmix_result hf_tag_spec_generate(const hf_tokenizer *tok, const char *template_name,
                                  const char *name, const char *description, tag_spec_doc *out,
                                  char *err, size_t err_bytes);

#endif

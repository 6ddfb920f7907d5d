/* Tests of the KV-cache policies and the kvmix-backed llama_kv_cache (tests/test_policy.c), run by
 * the model test binary. */
#ifndef TEST_POLICY_H
#define TEST_POLICY_H

/* Runs every check; adds to *n_passed and *n_failed and prints one line per failed check.
 * shared_dir holds models/kvm-small.safetensors and data/eval-dev.jsonl. */
void test_policy_run(const char *shared_dir, int *n_passed, int *n_failed);

#endif /* TEST_POLICY_H */

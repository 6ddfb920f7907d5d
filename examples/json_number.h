/* json_number.h - a double into a cJSON object so that it reads back to itself, for the examples'
 * JSON writers (policies, probe records). Header-only: include it after cjson/cJSON.h. */
#ifndef KVMIX_JSON_NUMBER_H
#define KVMIX_JSON_NUMBER_H

#include <stdio.h>
#include <stdlib.h>

/* cJSON writes a number with 15 significant digits whenever they read back within a relative
 * DBL_EPSILON of it: a double one ulp away from a 15-digit decimal does not read back to itself.
 * This writes the shortest of 15, 16 and 17 digits that reads back exactly (17 always does). */
static inline cJSON *json_add_exact_number(cJSON *obj, const char *name, double v) {
    char text[40];
    for (int digits = 15; digits <= 17; digits++) {
        snprintf(text, sizeof text, "%.*g", digits, v);
        if (strtod(text, NULL) == v) break;
    }
    return cJSON_AddRawToObject(obj, name, text);
}

#endif /* KVMIX_JSON_NUMBER_H */

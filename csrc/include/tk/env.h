// Host side: integer switches read from the environment by the bindings (kernel variants, most read on every
// call so that one process can time several). Torch-free; each binding turns a bad value into its own error.
#pragma once
#include <cstdlib>

namespace tk {

// Reads `name` into `value`: unset or empty leaves `value` as it is (the default). Returns false, with `value`
// unchanged, when the variable is set to anything but an integer in [0, count).
inline bool env_variant(const char* name, int count, int& value) {
    const char* env = std::getenv(name);
    if (env == nullptr || *env == '\0') return true;
    char* end = nullptr;
    const long v = std::strtol(env, &end, 10);
    if (*end != '\0' || v < 0 || v >= count) return false;
    value = int(v);
    return true;
}

}  // namespace tk

// Host side: integer switches read from the environment by the bindings (kernel variants, read on every call so
// that one process can time several). Torch-free; the binding turns a bad value into its own error.
#pragma once
#include <cstdlib>

namespace tk {

// The value of `name` if it is an integer in [0, count); `fallback` when unset or empty; -1 when malformed.
inline int env_variant(const char* name, int count, int fallback) {
    const char* env = std::getenv(name);
    if (env == nullptr || *env == '\0') return fallback;
    char* end = nullptr;
    const long v = std::strtol(env, &end, 10);
    return *end == '\0' && v >= 0 && v < count ? int(v) : -1;
}

}  // namespace tk

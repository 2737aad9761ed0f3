// The one binding file of moerun's native extension. Kernels live in their own files;
// this file only exposes them to Python with typed signatures.
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/map.h>

namespace nb = nanobind;

static std::map<std::string, bool> cpu_features() {
    __builtin_cpu_init();
    return {
        {"avx2", (bool)__builtin_cpu_supports("avx2")},
        {"fma", (bool)__builtin_cpu_supports("fma")},
        {"avx512f", (bool)__builtin_cpu_supports("avx512f")},
        {"avx512bw", (bool)__builtin_cpu_supports("avx512bw")},
        {"avx512vnni", (bool)__builtin_cpu_supports("avx512vnni")},
        {"avx512bf16", (bool)__builtin_cpu_supports("avx512bf16")},
    };
}

NB_MODULE(_native, m) {
    m.doc() = "moerun native CPU kernels";
    m.def("cpu_features", &cpu_features, "CPU instruction-set extensions this process can use");
}

// AMX (Intel's tile matrix unit) for the kernels built with AVX512-BF16: what a tile looks like and whether this
// process may use the tiles. Code using them compiles with target("amx-tile,amx-bf16") and calls amx_ready()
// first, so the same build runs on AVX512-BF16 CPUs without AMX (AMD Zen 4).
#pragma once

#if defined(__AVX512BF16__) && defined(__x86_64__)
#define KVSERVE_AMX 1
#include <cpuid.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cstdint>

namespace amx {

constexpr int64_t kTileRows = 16;
constexpr int64_t kTileValues = 32;  // bf16 values in a tile row (64 bytes)

// Palette 1's configuration: every tile used here is 16 rows of 64 bytes.
struct alignas(64) TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};

  explicit TileConfig(int num_tiles) {
    for (int t = 0; t < num_tiles; ++t) rows[t] = kTileRows, colsb[t] = 64;
  }
};

// Whether this CPU has AMX-BF16 and Linux lets this process use its tiles (asked once: arch_prctl).
inline bool ready() {
  static const bool is_ready = [] {
    unsigned a, b, c, d;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return false;
    const bool amx_bf16 = (d >> 22) & 1, amx_tile = (d >> 24) & 1;
    constexpr long kArchReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    return amx_bf16 && amx_tile && syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return is_ready;
}

}  // namespace amx
#endif

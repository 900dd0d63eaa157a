// What our AMX kernels share (q4_vnni.cpp's int8 tiles, decode_attention.cpp's bf16 tiles):
// whether the build has them, the tile config's layout, and the tile registers' permission.
#pragma once

#include <cstdint>
#if defined(__linux__)
#include <sys/syscall.h>
#include <unistd.h>
#endif

// AMX intrinsics as written in our kernels need GCC 11 (its target pragma; clang ignores it)
// and an assembler that knows the tile instructions, on Linux (arch_prctl). Where the build
// fails anyway, kernels/cpu/build.py's load() builds again with -DSALTSERVE_HAVE_AMX=0.
#ifndef SALTSERVE_HAVE_AMX
#if defined(__x86_64__) && defined(__linux__) && !defined(__clang__) && defined(__GNUC__) && \
    __GNUC__ >= 11
#define SALTSERVE_HAVE_AMX 1
#else
#define SALTSERVE_HAVE_AMX 0
#endif
#endif

namespace saltserve {

// The 64-byte operand of LDTILECFG (palette 1): each tile's rows and bytes a row. Loaded per
// thread before a kernel's tiles; GCC's _tile_loadconfig declares an 8-byte read, so a config
// lives in static memory.
struct alignas(64) TileConfig {
  uint8_t palette_id = 1, start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

#if SALTSERVE_HAVE_AMX
// Asks Linux for the tile registers (arch_prctl ARCH_REQ_XCOMP_PERM for XTILEDATA) for this
// process; true when granted. Callers ask once and keep the answer.
inline bool request_tile_data() {
  constexpr long kReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
  return syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureXtiledata) == 0;
}
#endif

}  // namespace saltserve

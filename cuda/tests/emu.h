// Host emulation of CUDA thread blocks for the jax_cgx kernel bodies.
//
// Each CUDA thread of a block is a ucontext fiber; all run on one OS thread.
// A fiber runs until it reaches a warp shuffle or a block barrier, then yields.
// A warp's shuffle is released when all 32 lanes of the warp wait at a
// shuffle (and they must agree on the kind and width, else it is reported);
// the block barrier when all threads wait at it. A warp with exited lanes
// that shuffles, or a barrier some threads never reach, is reported as an
// error (it is undefined behaviour on the GPU).
#pragma once

#include <ucontext.h>

#include <cstdio>
#include <cstdlib>
#include <functional>
#include <vector>

#define JAX_CGX_HOST_EMULATION 1
// The whole kernel translation unit (with codec_device.cuh and quantize_kernels.cuh).
#include "cuda/codec_kernels.cu"

namespace emu_rt {

using jax_cgx::cuda::detail::ThreadPos;

enum class State { kRunnable, kShfl, kBarrier, kDone };

struct Fiber {
  ucontext_t ctx;
  std::vector<char> stack;
  ThreadPos pos;
  State state = State::kRunnable;
  // pending shuffle
  int kind = 0;  // 1 = shfl(src, width), 2 = shfl_xor(mask)
  uint32_t value = 0;
  int arg = 0;
  int width = 0;
  uint32_t result = 0;
};

struct Block {
  std::vector<Fiber> fibers;
  ucontext_t main_ctx;
  int current = -1;
  const std::function<void()>* body = nullptr;
};

inline Block* g_block = nullptr;
inline long g_errors = 0;

inline void fail(const char* what) {
  std::fprintf(stderr, "EMULATION ERROR: %s\n", what);
  std::abort();
}

inline void yield_to_main() {
  Fiber& f = g_block->fibers[g_block->current];
  swapcontext(&f.ctx, &g_block->main_ctx);
}

inline void trampoline() {
  (*g_block->body)();
  g_block->fibers[g_block->current].state = State::kDone;
  // returning goes to uc_link = main_ctx
}

// Runs `body` as a kernel over grid x block threads (blocks one after another).
inline void launch(int grid, int block_threads, const std::function<void()>& body) {
  if (block_threads % 32 != 0) fail("block size must be a multiple of 32");
  for (int b = 0; b < grid; ++b) {
    Block blk;
    blk.body = &body;
    blk.fibers.resize(block_threads);
    g_block = &blk;
    for (int t = 0; t < block_threads; ++t) {
      Fiber& f = blk.fibers[t];
      f.stack.resize(256 * 1024);
      f.pos = ThreadPos{t, b, block_threads, grid};
      getcontext(&f.ctx);
      f.ctx.uc_stack.ss_sp = f.stack.data();
      f.ctx.uc_stack.ss_size = f.stack.size();
      f.ctx.uc_link = &blk.main_ctx;
      makecontext(&f.ctx, trampoline, 0);
    }
    const int warps = block_threads / 32;
    for (;;) {
      bool ran = false;
      for (int t = 0; t < block_threads; ++t) {
        if (blk.fibers[t].state != State::kRunnable) continue;
        blk.current = t;
        swapcontext(&blk.main_ctx, &blk.fibers[t].ctx);
        blk.current = -1;
        ran = true;
      }
      bool released = false;
      // warp shuffles
      for (int w = 0; w < warps; ++w) {
        Fiber* lanes = &blk.fibers[w * 32];
        int waiting = 0, done = 0;
        for (int l = 0; l < 32; ++l) {
          waiting += lanes[l].state == State::kShfl;
          done += lanes[l].state == State::kDone;
        }
        if (waiting == 0) continue;
        if (waiting + done == 32 && done > 0) fail("shuffle in a warp with exited lanes");
        if (waiting != 32) continue;  // others still running or at the block barrier
        for (int l = 1; l < 32; ++l) {
          if (lanes[l].kind != lanes[0].kind || lanes[l].width != lanes[0].width)
            fail("lanes of a warp disagree on the shuffle");
        }
        for (int l = 0; l < 32; ++l) {
          int src;
          if (lanes[l].kind == 1) {
            const int width = lanes[l].width;
            src = (l & ~(width - 1)) + (lanes[l].arg & (width - 1));
          } else {
            src = l ^ lanes[l].arg;
          }
          lanes[l].result = lanes[src].value;
        }
        for (int l = 0; l < 32; ++l) lanes[l].state = State::kRunnable;
        released = true;
      }
      // block barrier
      int at_barrier = 0, done = 0, live = 0;
      for (auto& f : blk.fibers) {
        at_barrier += f.state == State::kBarrier;
        done += f.state == State::kDone;
        live += f.state != State::kDone;
      }
      if (live == 0) break;
      if (at_barrier > 0 && at_barrier + done == block_threads) {
        if (done > 0) fail("block barrier not reached by exited threads");
        for (auto& f : blk.fibers) f.state = State::kRunnable;
        released = true;
      }
      if (!ran && !released) fail("deadlock (mixed shuffle/barrier waits)");
    }
    g_block = nullptr;
  }
}

}  // namespace emu_rt

namespace jax_cgx::cuda::detail::emu {

ThreadPos position() { return emu_rt::g_block->fibers[emu_rt::g_block->current].pos; }

uint32_t shfl(uint32_t v, int src_lane, int width) {
  auto& f = emu_rt::g_block->fibers[emu_rt::g_block->current];
  if (width < 1 || width > 32 || (width & (width - 1))) emu_rt::fail("bad shuffle width");
  f.kind = 1;
  f.value = v;
  f.arg = src_lane;
  f.width = width;
  f.state = emu_rt::State::kShfl;
  emu_rt::yield_to_main();
  return f.result;  // `f` stays valid: fibers never reallocate during a block
}

uint32_t shfl_xor(uint32_t v, int lane_mask) {
  auto& f = emu_rt::g_block->fibers[emu_rt::g_block->current];
  if (lane_mask < 0 || lane_mask > 31) emu_rt::fail("bad xor mask");
  f.kind = 2;
  f.value = v;
  f.arg = lane_mask;
  f.width = 32;
  f.state = emu_rt::State::kShfl;
  emu_rt::yield_to_main();
  return f.result;
}

void sync_block() {
  auto& f = emu_rt::g_block->fibers[emu_rt::g_block->current];
  f.state = emu_rt::State::kBarrier;
  emu_rt::yield_to_main();
}

}  // namespace jax_cgx::cuda::detail::emu

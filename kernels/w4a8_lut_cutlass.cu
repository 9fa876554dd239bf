// SVDQuant W4 x e4m3 GEMM on Hopper (sm_90a): the int4 weights turned into e4m3 inside the GEMM by a
// per-(row, K-group) lookup table, CUTLASS's mixed-input TMA warp-specialized mainloop (the narrow operand
// passes through registers, the wgmma's register-sourced A operand).
//
// Arithmetic (the problem as the kernel sees it: rows n < N of the weight, columns m < M of the tokens):
//
//   D[m, n] = bf16( sx[m] * (sw[n] * sum_k LUT[n, k / 64](W[n, k]) * X[m, k]) + bias[n] )
//
// W holds 4-bit codes; LUT[n, g] maps a code to an e4m3 value. The table of one (n, g) is eight e4m3
// bytes T[0..7] (CUTLASS's "packed scale", cutlass::Array<float_e4m3_t, 8>): a code with its top bit set
// reads T[code & 7], a code without it reads -T[code & 7], except code 0, which is 0. So a table holds
// fifteen values, symmetric but for T[0]; dit_passes/quant/w4_lut.py builds the codes and tables from
// SVDQuant's int4 weights (T[i] = e4m3((i - 8) * wscale[n, g] / sw[n]), codes of q >= 1 as those of -q
// without the sign) and from the low-rank up projection's two int4 digit planes. Products of e4m3 values
// are exact in the tensor cores' fp32 accumulation, so the only roundings are the tables' and the sums'.
//
// Memory layouts (device pointers; L = 1):
//   W      int4 codes [N, K] in the shuffled layout (w4a8_lut_shuffle_offsets; w4_lut.shuffle_index: the 16
//          codes one thread feeds a wgmma side by side, two codes a byte).                  ptr % 16 == 0
//   T      uint64 (eight e4m3 bytes) [N, K / 64] with strides (1, N): N-major, T[g * N + n]. ptr % 8 == 0
//   X      float8_e4m3fn [M, K] row-major.                                                  ptr % 16 == 0
//   sw     float32 [N]; sx float32 [M]; bias bfloat16 [N] or NULL (then 0).                 ptr % 4 == 0
//   D      bfloat16 [M, N] row-major (the kernel's [N, M] column-major result).               ptr % 16 == 0
//   N % 16 == 0, M % 8 == 0, K % 64 == 0.
//
// Exported C ABI: per config NAME in w4a8_lut_configs():
//   int w4a8_lut_gemm_NAME(w, t, x, sw, sx, bias_or_null, d, M, N, K, workspace, workspace_bytes, stream)
//   int64_t w4a8_lut_workspace_NAME(M, N, K)
// and int w4a8_lut_shuffle_offsets(N, K, out) (host: where the shuffled layout puts each code),
// const char* w4a8_lut_configs(), const char* w4a8_lut_last_error_detail(), int w4a8_lut_abi_version().
// One translation unit per config with -DW4A8_LUT_CONFIG_INDEX=i (index 0 also holds the common parts).

#include <cstdint>
#include <cstdio>
#include <exception>

#include <cuda_runtime.h>

#include "cutlass/cutlass.h"
#include "cutlass/numeric_types.h"
#include "cute/tensor.hpp"
#include "cutlass/epilogue/collective/collective_builder.hpp"
#include "cutlass/epilogue/fusion/sm90_callbacks_tma_warpspecialized.hpp"
#include "cutlass/gemm/collective/collective_builder.hpp"
#include "cutlass/gemm/device/gemm_universal_adapter.h"
#include "cutlass/gemm/dispatch_policy.hpp"
#include "cutlass/gemm/kernel/gemm_universal.hpp"

#if !defined(CUTLASS_ARCH_MMA_SM90_SUPPORTED)
#define W4A8_LUT_NO_SM90 1
#endif

namespace w4lut {

enum Error { kOk = 0, kErrNullPointer = 1, kErrBadShape = 2, kErrMisaligned = 3, kErrNotSm90 = 4,
             kErrCanImplement = 5, kErrWorkspaceTooSmall = 6, kErrInitialize = 7, kErrRun = 8, kErrCuda = 9,
             kErrException = 10, kErrNotCompiled = 11 };

#if !defined(W4A8_LUT_CONFIG_INDEX) || W4A8_LUT_CONFIG_INDEX == 0
char g_detail[256];
#else
extern char g_detail[256];
#endif

inline void set_detail(const char* a, const char* b = nullptr) {
  std::snprintf(g_detail, sizeof(g_detail), "%s%s%s", a, b ? ": " : "", b ? b : "");
}

inline int device_sm_count(int* dev) {
  if (cudaGetDevice(dev) != cudaSuccess) return 0;
  cudaDeviceProp prop;
  if (cudaGetDeviceProperties(&prop, *dev) != cudaSuccess) return 0;
  return prop.major == 9 ? prop.multiProcessorCount : -1;
}

using namespace cute;

using ElementW = cutlass::int4b_t;
using ElementX = cutlass::float_e4m3_t;
using ElementTable = cutlass::Array<cutlass::float_e4m3_t, 8>;   // the LUT mode of the mixed-input mainloop
using ElementD = cutlass::bfloat16_t;
constexpr int kGroupK = 64;                  // the tables' K-group is the tile's K (the mainloop's minimum)
constexpr int kAlignW = 32;                  // elements: 16 bytes of int4
constexpr int kAlignX = 16;
constexpr int kAlignD = 8;

using StrideW = cutlass::detail::TagToStrideA_t<cutlass::layout::RowMajor>;      // [N, K], K contiguous
using StrideX = cutlass::detail::TagToStrideB_t<cutlass::layout::ColumnMajor>;   // [M, K], K contiguous
// [rows, K] with K contiguous, the stride type of both operands (K-major W as A, K-major X as B).
inline StrideW k_major(int rows, int k) { return make_stride(int64_t(k), _1{}, int64_t(rows) * k); }
static_assert(std::is_same_v<StrideW, StrideX>, "both operands K-major");

// The shuffled weight: the 16 codes a thread of a warp feeds one register-sourced fp8 wgmma (m64 k32)
// side by side in memory, so a thread loads them from shared memory in one 64-bit access instead of four
// 16-bit ones. A warp's share of the MMA's A tile is 16 rows x 32 k; its thread-value layout (the MMA
// traits' ALayout, restricted to the warp's 32 threads) is inverted into (row, k) -> (thread, value) and
// composed with offset = thread * 16 + value. Any layout is correct (the codes are written with the one
// the kernel reads); this one is the fast one.
struct Shuffle {
  using MmaAtom = decltype(SM90::GMMA::rs_op_selector<cutlass::float_e4m3_t, cutlass::float_e4m3_t, float,
                                                      Shape<_64, _16, _32>>());
  using TV = typename MMA_Traits<MmaAtom>::ALayout;                  // (thread 128, value 16) -> m + 64 k
  static constexpr int kVals = size<1>(TV{});
  static auto atom() {
    auto warp_tv = make_layout_like(composition(TV{}, make_shape(Int<32>{}, Int<kVals>{})));
    auto rowk_to_tv = right_inverse(warp_tv).with_shape(make_shape(Int<16>{}, Int<32>{}));
    auto tv_to_offset = make_layout(make_shape(Int<32>{}, Int<kVals>{}), make_stride(Int<kVals>{}, _1{}));
    return composition(tv_to_offset, rowk_to_tv);
  }
};
using ShuffleAtom = decltype(Shuffle::atom());
using LayoutWShuffled = decltype(cute::tile_to_shape(ShuffleAtom{}, Layout<Shape<int, int, int>, StrideW>{}));

// The epilogue: D = sx[col] * (sw[row] * acc) + bias[row], one bf16 rounding (rows: weight rows n).
template <class TileShape>
struct Epilogue {
  using Acc = cutlass::epilogue::fusion::Sm90AccFetch;
  using RowScale = cutlass::epilogue::fusion::Sm90ColBroadcast<0, TileShape, float, float,
                                                                Stride<_1, _0, int64_t>, 4>;
  using ColScale = cutlass::epilogue::fusion::Sm90RowBroadcast<0, TileShape, float, float,
                                                                Stride<_0, _1, int64_t>, 4>;
  using Bias = cutlass::epilogue::fusion::Sm90ColBroadcast<0, TileShape, ElementD, float,
                                                            Stride<_1, _0, int64_t>, 8>;
  using Mul = cutlass::epilogue::fusion::Sm90Compute<cutlass::multiplies, float, float,
                                                     cutlass::FloatRoundStyle::round_to_nearest>;
  using MulAdd = cutlass::epilogue::fusion::Sm90Compute<cutlass::homogeneous_multiply_add, ElementD, float,
                                                        cutlass::FloatRoundStyle::round_to_nearest>;
  using Scaled = cutlass::epilogue::fusion::Sm90EVT<Mul, RowScale, Acc>;
  using Tree = cutlass::epilogue::fusion::Sm90EVT<MulAdd, ColScale, Scaled, Bias>;
};

template <int TM, int TN, int CM, bool Cooperative>
struct Config {
  using TileShape = Shape<Int<TM>, Int<TN>, Int<kGroupK>>;
  using ClusterShape = Shape<Int<CM>, _1, _1>;   // CM > 1: CTAs of CM weight-row tiles share (multicast) a token tile
  using KernelSchedule = std::conditional_t<Cooperative, cutlass::gemm::KernelTmaWarpSpecializedCooperative,
                                            cutlass::gemm::KernelTmaWarpSpecializedPingpong>;
  using EpilogueSchedule = std::conditional_t<Cooperative, cutlass::epilogue::TmaWarpSpecializedCooperative,
                                              cutlass::epilogue::TmaWarpSpecialized>;
  using Evt = typename Epilogue<TileShape>::Tree;
  using CollectiveEpilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TileShape, ClusterShape,
      cutlass::epilogue::collective::EpilogueTileAuto, float, float,
      void, cutlass::layout::ColumnMajor, kAlignD,
      ElementD, cutlass::layout::ColumnMajor, kAlignD,
      EpilogueSchedule, Evt>::CollectiveOp;
  using CollectiveMainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp,
      cute::tuple<ElementW, ElementTable>, LayoutWShuffled, kAlignW,
      ElementX, StrideX, kAlignX,
      float, TileShape, ClusterShape,
      cutlass::gemm::collective::StageCountAutoCarveout<
          static_cast<int>(sizeof(typename CollectiveEpilogue::SharedStorage))>,
      KernelSchedule>::CollectiveOp;
  using GemmKernel = cutlass::gemm::kernel::GemmUniversal<Shape<int, int, int, int>, CollectiveMainloop,
                                                          CollectiveEpilogue>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<GemmKernel>;
  using Arguments = typename Gemm::Arguments;
  using StrideD = typename GemmKernel::StrideD;
  using StrideTable = typename CollectiveMainloop::StrideScale;

  // Kernel problem: rows = N (weights), cols = M (tokens), K.
  static Arguments make_args(const void* w, const void* t, const void* x, const void* sw, const void* sx,
                             const void* bias, void* d, int M, int N, int K, int sm_count) {
    auto w_layout = cute::tile_to_shape(ShuffleAtom{}, make_layout(make_shape(N, K, 1), k_major(N, K)));
    StrideX stride_x = k_major(M, K);
    StrideD stride_d = make_stride(_1{}, int64_t(N), int64_t(N) * M);                  // [N, M] column-major
    StrideTable stride_t = make_stride(_1{}, int64_t(N), int64_t(N) * (K / kGroupK));   // [N, G] N-major
    cutlass::KernelHardwareInfo hw;
    hw.device_id = 0;
    hw.sm_count = sm_count;
    Arguments args{
        cutlass::gemm::GemmUniversalMode::kGemm,
        {N, M, K, 1},
        {static_cast<const ElementW*>(w), w_layout, static_cast<const ElementX*>(x), stride_x,
         static_cast<const ElementTable*>(t), stride_t, kGroupK},
        {{}, nullptr, stride_d, static_cast<ElementD*>(d), stride_d},
        hw};
    // The tree's arguments follow its nodes: {ColScale, {RowScale, Acc, Mul}, Bias, MulAdd}.
    args.epilogue.thread = {
        {static_cast<const float*>(sx), 0.0f, {}},
        {{static_cast<const float*>(sw), 0.0f, {}}, {}, {}},
        {static_cast<const ElementD*>(bias), ElementD(0), {}},
        {}};
    return args;
  }

  static int64_t workspace_size(int M, int N, int K) {
    if (M <= 0 || N <= 0 || K <= 0) return -int64_t(kErrBadShape);
    int dev = 0;
    int sms = device_sm_count(&dev);
    Arguments args = make_args(nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, M, N, K,
                               sms > 0 ? sms : 132);
    return int64_t(Gemm::get_workspace_size(args));
  }

  static int run(const void* w, const void* t, const void* x, const void* sw, const void* sx, const void* bias,
                 void* d, int M, int N, int K, void* workspace, size_t workspace_bytes, cudaStream_t stream) {
    g_detail[0] = 0;
    if (!w || !t || !x || !sw || !sx || !d) { set_detail("null device pointer (all but bias are required)");
                                              return kErrNullPointer; }
    if (M <= 0 || N <= 0 || K <= 0 || K % kGroupK || N % 16 || M % 8) {
      char buf[120];
      std::snprintf(buf, sizeof(buf), "M=%d N=%d K=%d (need M %% 8 == 0, N %% 16 == 0, K %% 64 == 0)", M, N, K);
      set_detail("bad problem shape", buf);
      return kErrBadShape;
    }
    auto mis = [](const void* p, uintptr_t a) { return p && (reinterpret_cast<uintptr_t>(p) & (a - 1)) != 0; };
    if (mis(w, 16) || mis(x, 16) || mis(d, 16) || mis(t, 8) || mis(sw, 4) || mis(sx, 4) || mis(bias, 16)) {
      set_detail("misaligned pointer (w, x, bias, out: 16 bytes; tables 8; scales 4)");
      return kErrMisaligned;
    }
    int dev = 0;
    int sms = device_sm_count(&dev);
    if (sms == 0) { set_detail("could not query the current CUDA device"); return kErrCuda; }
    if (sms < 0) { set_detail("the current CUDA device is not compute capability 9.x"); return kErrNotSm90; }
    Arguments args = make_args(w, t, x, sw, sx, bias, d, M, N, K, sms);
    args.hw_info.device_id = dev;
    Gemm gemm;
    cutlass::Status st = gemm.can_implement(args);
    if (st != cutlass::Status::kSuccess) { set_detail("can_implement", cutlassGetStatusString(st));
                                           return kErrCanImplement; }
    size_t need = Gemm::get_workspace_size(args);
    if (need > 0 && (!workspace || workspace_bytes < need)) { set_detail("workspace too small");
                                                              return kErrWorkspaceTooSmall; }
    st = gemm.initialize(args, workspace, stream);
    if (st != cutlass::Status::kSuccess) { set_detail("initialize", cutlassGetStatusString(st)); return kErrInitialize; }
    st = gemm.run(stream);
    if (st != cutlass::Status::kSuccess) {
      cudaError_t e = cudaGetLastError();
      set_detail(cutlassGetStatusString(st), e != cudaSuccess ? cudaGetErrorString(e) : nullptr);
      return kErrRun;
    }
    return kOk;
  }
};

}  // namespace w4lut

#define W4A8_LUT_API extern "C" __attribute__((visibility("default")))
#define W4A8_LUT_ENTRY(NAME, ...)                                                                         \
  W4A8_LUT_API int w4a8_lut_gemm_##NAME(const void* w, const void* t, const void* x, const void* sw,       \
                                        const void* sx, const void* bias, void* d, int M, int N, int K,    \
                                        void* ws, size_t ws_bytes, void* stream) {                         \
    try {                                                                                                 \
      return w4lut::Config<__VA_ARGS__>::run(w, t, x, sw, sx, bias, d, M, N, K, ws, ws_bytes,             \
                                             static_cast<cudaStream_t>(stream));                          \
    } catch (const std::exception& e) {                                                                   \
      w4lut::set_detail("C++ exception", e.what());                                                       \
      return w4lut::kErrException;                                                                        \
    }                                                                                                     \
  }                                                                                                       \
  W4A8_LUT_API int64_t w4a8_lut_workspace_##NAME(int M, int N, int K) {                                   \
    try {                                                                                                 \
      return w4lut::Config<__VA_ARGS__>::workspace_size(M, N, K);                                          \
    } catch (...) {                                                                                       \
      return -int64_t(w4lut::kErrException);                                                              \
    }                                                                                                     \
  }

// (tile rows of W x tile columns of tokens, cluster along W's rows, schedule). On an H100 at FLUX's shapes (4608
// tokens) 128x256 cooperative is the fastest, as fast as cuBLAS's fp8 GEMM on the expanded weight; the smaller tiles
// and ping-pong are slower (bench/results/lut_gemm_configs_h100.md).
#if !defined(W4A8_LUT_CONFIG_INDEX) || W4A8_LUT_CONFIG_INDEX == 0
W4A8_LUT_ENTRY(coop_128x256, 128, 256, 1, true)
#endif
#if !defined(W4A8_LUT_CONFIG_INDEX) || W4A8_LUT_CONFIG_INDEX == 1
W4A8_LUT_ENTRY(coop_128x256_c2x1, 128, 256, 2, true)
#endif
#if !defined(W4A8_LUT_CONFIG_INDEX) || W4A8_LUT_CONFIG_INDEX == 2
W4A8_LUT_ENTRY(pingpong_64x256, 64, 256, 1, false)
#endif
#if !defined(W4A8_LUT_CONFIG_INDEX) || W4A8_LUT_CONFIG_INDEX == 3
W4A8_LUT_ENTRY(coop_128x128, 128, 128, 1, true)
#endif
#if !defined(W4A8_LUT_CONFIG_INDEX) || W4A8_LUT_CONFIG_INDEX == 4
W4A8_LUT_ENTRY(coop_256x128, 256, 128, 1, true)
#endif

#if !defined(W4A8_LUT_CONFIG_INDEX) || W4A8_LUT_CONFIG_INDEX == 0
W4A8_LUT_API const char* w4a8_lut_configs() {
  return "coop_128x256,coop_128x256_c2x1,pingpong_64x256,coop_128x128,coop_256x128";
}
W4A8_LUT_API int w4a8_lut_abi_version() { return 1; }
W4A8_LUT_API const char* w4a8_lut_last_error_detail() { return w4lut::g_detail; }

// The shuffled layout as offsets (host code): out[n * K + k] = the position of code (n, k) in the layout
// the *_shuffled configs read; w4_lut.py permutes the codes with it once, at load time.
W4A8_LUT_API int w4a8_lut_shuffle_offsets(int N, int K, int32_t* out) {
  using namespace cute;
  if (!out) { w4lut::set_detail("null output"); return w4lut::kErrNullPointer; }
  if (N % 16 || K % w4lut::kGroupK) { w4lut::set_detail("shuffle: N % 16 and K % 64 must be 0");
                                      return w4lut::kErrBadShape; }
  auto layout = tile_to_shape(w4lut::ShuffleAtom{}, make_layout(make_shape(N, K, 1), w4lut::k_major(N, K)));
  for (int n = 0; n < N; ++n)
    for (int k = 0; k < K; ++k) out[int64_t(n) * K + k] = int32_t(layout(n, k, 0));
  return w4lut::kOk;
}
#endif

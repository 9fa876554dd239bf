// W4A4 (SVDQuant) GEMM on Hopper (sm_90a) with CUTLASS's FP8 groupwise-scaled TMA mainloop.
//
// Arithmetic (for every output row m < M and column n < N, G = K / 64 groups):
//
//   D[m, n] = bf16( sum_g SFA[m, g] * SFB[n, g] * dot(A[m, 64g : 64g+64], W[n, 64g : 64g+64])  +  C[m, n] )
//
// A and W hold int4 values (-8..7) stored as float8_e4m3fn (exact); a per-group dot is an integer with
// |d| <= 64*8*8 = 4096 and is exact in the fp32 tensor-core accumulation. Each K-group's partial sum is
// promoted into the fp32 main accumulator with one FFMA chain: acc += partial * SFA[m, g] * SFB[n, g]
// (cutlass::gemm::collective::GmmaFP8Accumulation, "scale_core(scaleA, scaleB)"). C is added by the
// epilogue as D = 1 * acc + beta * C with beta = 1 (C given) or beta = 0 (C absent: C is never read).
//
// Memory layouts (all device pointers; L = 1, no batching):
//   A      float8_e4m3fn [M, K] row-major (K contiguous, row stride K bytes).           ptr % 16 == 0
//   W      float8_e4m3fn [N, K] row-major (K contiguous) == CUTLASS "ColumnMajor" B.     ptr % 16 == 0
//   SFA    float32 [M, G] with strides (1, M): M-major ("MN-major" in CUTLASS terms), i.e. G blocks
//          of M contiguous floats; element (m, g) at SFA[g * M + m].                     ptr % 4 == 0
//   SFB    float32 [N, G] with strides (1, N): N-major; element (n, g) at SFB[g * N + n]. ptr % 4 == 0
//   C      bfloat16 [M, N] row-major (N contiguous) or NULL.                             ptr % 16 == 0
//   D      bfloat16 [M, N] row-major (N contiguous).                                     ptr % 16 == 0
//   M >= 1 arbitrary (TMA zero-fills / clips the M tail; the scale loads are predicated),
//   N % 16 == 0 (TMA needs 16-byte row strides for D/C: N % 8; we ask 16), K % 64 == 0, K >= 64.
// These are CUTLASS's Sm90BlockwiseScaleConfig<1, 1, 64, MN, MN> layouts
// (cutlass/detail/blockwise_scale_layout.hpp: tile_atom_to_shape_SFA/SFB with MN-major strides).
//
// Kernel classes: cutlass::gemm::collective::CollectiveBuilder<Sm90, OpClassTensorOp, e4m3 x e4m3,
// tuple<RowMajor, LayoutSFA>, tuple<ColumnMajor, LayoutSFB>, float accum, ..., Kernel schedule
// KernelTmaWarpSpecialized{Cooperative,Pingpong}FP8Blockwise> which selects the collective
// MainloopSm90TmaGmmaWarpSpecializedBlockwiseFP8 (sm90_mma_tma_gmma_ss_warpspecialized_fp8_blockwise_
// scaling.hpp); epilogue: Sm90 TMA warp-specialized epilogue with fusion::LinearCombination<bf16,
// float, bf16, float>; kernel: GemmUniversal with the default persistent tile scheduler.
//
// K-granularity 64 needs ONE relaxation of CUTLASS 4.2.0: the mainloop requires
// ScaleGranularityK == tile K (it reads one scale per k-tile) and additionally
// static_asserts ScalePromotionInterval (= ScaleGranularityK / 32, the fp8 wgmma K) % 4 == 0, i.e.
// ScaleGranularityK a multiple of 128. With granularity 64 (tile K 64) the interval is 2, which the
// promotion logic handles (it promotes whenever its MMA counter reaches the interval, i.e. after
// every k-tile here). kernels/w4a4_cutlass.py builds against a patched copy of that one header
// (the %4 assert relaxed, and the "finest granularity" fast path keyed on interval == k-blocks
// per tile instead of interval == 4); the patched header defines W4A4_CUTLASS_PATCHED_SM90_BLOCKWISE
// and this file refuses to compile without it.
//
// Exported C ABI (see the bottom of the file): per config NAME in w4a4_cutlass_configs():
//   int     w4a4_cutlass_gemm_NAME(a, sfa, w, sfb, c_or_null, d, M, N, K, workspace, workspace_bytes, stream)
//   int64_t w4a4_cutlass_workspace_NAME(M, N, K)      (bytes; < 0 is minus an error code)
// plus  const char* w4a4_cutlass_configs(), const char* w4a4_cutlass_error_string(int),
//       const char* w4a4_cutlass_last_error_detail(), int w4a4_cutlass_abi_version() (2),
//       int w4a4_cutlass_set_scheduler(max_swizzle, raster_order) (persistent tile order, all configs).
// The file compiles as one translation unit, or as one per config with -DW4A4_CONFIG_INDEX=i (index 0
// also holds the common functions and globals), linked into one library (kernels/w4a4_cutlass.py).

#include <cstdint>
#include <cstdio>
#include <cstring>
#include <exception>

#include <cuda_runtime.h>

#include "cutlass/cutlass.h"
#include "cutlass/numeric_types.h"
#include "cute/tensor.hpp"
#include "cutlass/gemm/dispatch_policy.hpp"
#include "cutlass/gemm/collective/collective_builder.hpp"
#include "cutlass/epilogue/dispatch_policy.hpp"
#include "cutlass/epilogue/collective/collective_builder.hpp"
#include "cutlass/epilogue/fusion/operations.hpp"
#include "cutlass/gemm/kernel/gemm_universal.hpp"
#include "cutlass/gemm/device/gemm_universal_adapter.h"
#include "cutlass/detail/blockwise_scale_layout.hpp"
#include "cutlass/kernel_hardware_info.h"

#if !defined(W4A4_CUTLASS_PATCHED_SM90_BLOCKWISE)
#error "w4a4_cutlass.cu needs the patched sm90 blockwise mainloop header (K-group 64); build it with kernels/w4a4_cutlass.py (it puts the patched copy first on the include path)"
#endif

namespace w4a4 {

enum Code : int {
  kOk = 0,
  kErrNullPointer = 1,
  kErrBadShape = 2,
  kErrMisaligned = 3,
  kErrNotSm90 = 4,
  kErrCanImplement = 5,
  kErrWorkspaceTooSmall = 6,
  kErrInitialize = 7,
  kErrRun = 8,
  kErrCuda = 9,
  kErrException = 10,
  kErrNotCompiled = 11,
};

// One error-detail buffer for the whole library, also when it is built from one translation unit per
// config (W4A4_CONFIG_INDEX = 0, 1, ...; index 0 also holds the common C functions).
// Likewise the persistent tile scheduler's options (w4a4_cutlass_set_scheduler), read by every config.
#if !defined(W4A4_CONFIG_INDEX) || W4A4_CONFIG_INDEX == 0
thread_local char g_detail[512] = {0};
int g_max_swizzle = 1;    // 1, 2, 4 or 8 (CUTLASS rounds down to a power of two)
int g_raster_order = 0;   // 0 heuristic, 1 along M, 2 along N
#else
extern thread_local char g_detail[512];
extern int g_max_swizzle;
extern int g_raster_order;
#endif

static void set_detail(const char* what, const char* more = nullptr) {
  std::snprintf(g_detail, sizeof(g_detail), "%s%s%s", what, more ? ": " : "", more ? more : "");
}

static const char* status_name(cutlass::Status s) { return cutlass::cutlassGetStatusString(s); }

// ---------------------------------------------------------------------------------------------
// Device information, cached per device ordinal (one cudaGetDevice per call, no attribute query).
// ---------------------------------------------------------------------------------------------
static constexpr int kMaxDevices = 64;
static int g_sm_count[kMaxDevices] = {0};   // 0: unknown, -1: not sm_90
static int device_sm_count(int* dev_out) {
  int dev = 0;
  if (cudaGetDevice(&dev) != cudaSuccess) { cudaGetLastError(); return 0; }
  *dev_out = dev;
  if (dev >= 0 && dev < kMaxDevices && g_sm_count[dev] != 0) return g_sm_count[dev];
  int major = 0, sms = 0;
  if (cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev) != cudaSuccess ||
      cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev) != cudaSuccess) {
    cudaGetLastError();
    return 0;
  }
  int v = (major == 9) ? sms : -1;
  if (dev >= 0 && dev < kMaxDevices) g_sm_count[dev] = v;
  return v;
}

// ---------------------------------------------------------------------------------------------
// One GEMM configuration.
// ---------------------------------------------------------------------------------------------
using ElementA = cutlass::float_e4m3_t;
using ElementB = cutlass::float_e4m3_t;
using ElementC = cutlass::bfloat16_t;
using ElementD = cutlass::bfloat16_t;
using ElementAccumulator = float;
using ElementCompute = float;
using LayoutA = cutlass::layout::RowMajor;       // A [M, K], K contiguous
using LayoutB = cutlass::layout::ColumnMajor;    // B [K, N] column-major == W [N, K] row-major
using LayoutC = cutlass::layout::RowMajor;       // C, D [M, N], N contiguous
constexpr int kAlignA = 16;                      // elements (16 bytes of fp8)
constexpr int kAlignB = 16;
constexpr int kAlignC = 8;                       // elements (16 bytes of bf16)
constexpr int kAlignD = 8;
constexpr int kGroupK = 64;

// Per-token / per-channel / per-64-K scales, both MN-major (see the header comment).
using ScaleConfig = cutlass::detail::Sm90BlockwiseScaleConfig<1, 1, kGroupK,
                                                              cute::GMMA::Major::MN, cute::GMMA::Major::MN>;
using LayoutSFA = decltype(ScaleConfig::deduce_layoutSFA());
using LayoutSFB = decltype(ScaleConfig::deduce_layoutSFB());

template <int TM, int TN, int CM, int CN, bool Cooperative>
struct Config {
  using TileShape = cute::Shape<cute::Int<TM>, cute::Int<TN>, cute::Int<kGroupK>>;
  using ClusterShape = cute::Shape<cute::Int<CM>, cute::Int<CN>, cute::_1>;
  using KernelSchedule = std::conditional_t<Cooperative,
                                            cutlass::gemm::KernelTmaWarpSpecializedCooperativeFP8Blockwise,
                                            cutlass::gemm::KernelTmaWarpSpecializedPingpongFP8Blockwise>;
  using EpilogueSchedule = std::conditional_t<Cooperative,
                                              cutlass::epilogue::TmaWarpSpecializedCooperative,
                                              cutlass::epilogue::TmaWarpSpecialized>;
  using Fusion = cutlass::epilogue::fusion::LinearCombination<ElementD, ElementCompute, ElementC, ElementCompute>;

  using CollectiveEpilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp,
      TileShape, ClusterShape, cutlass::epilogue::collective::EpilogueTileAuto,
      ElementAccumulator, ElementCompute,
      ElementC, LayoutC, kAlignC,
      ElementD, LayoutC, kAlignD,
      EpilogueSchedule, Fusion>::CollectiveOp;

  using CollectiveMainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp,
      ElementA, cute::tuple<LayoutA, LayoutSFA>, kAlignA,
      ElementB, cute::tuple<LayoutB, LayoutSFB>, kAlignB,
      ElementAccumulator, TileShape, ClusterShape,
      cutlass::gemm::collective::StageCountAutoCarveout<
          static_cast<int>(sizeof(typename CollectiveEpilogue::SharedStorage))>,
      KernelSchedule>::CollectiveOp;

  static_assert(CollectiveMainloop::ScaleGranularityM == 1, "per-token A scales");
  static_assert(CollectiveMainloop::ScaleGranularityN == 1, "per-channel W scales");
  static_assert(CollectiveMainloop::ScaleGranularityK == kGroupK, "K-group of 64");
  static_assert(CollectiveMainloop::MMajorSFA && CollectiveMainloop::NMajorSFB, "MN-major scale layouts");

  using GemmKernel = cutlass::gemm::kernel::GemmUniversal<
      cute::Shape<int, int, int, int>, CollectiveMainloop, CollectiveEpilogue>;  // persistent scheduler
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<GemmKernel>;
  using Arguments = typename Gemm::Arguments;
  using StrideA = typename GemmKernel::StrideA;
  using StrideB = typename GemmKernel::StrideB;
  using StrideC = typename GemmKernel::StrideC;
  using StrideD = typename GemmKernel::StrideD;

  static Arguments make_args(const void* a, const void* sfa, const void* w, const void* sfb,
                             const void* c, void* d, int M, int N, int K, int sm_count) {
    StrideA stride_a = cute::make_stride(int64_t(K), cute::Int<1>{}, int64_t(M) * K);
    StrideB stride_b = cute::make_stride(int64_t(K), cute::Int<1>{}, int64_t(N) * K);
    StrideC stride_c = cute::make_stride(int64_t(N), cute::Int<1>{}, int64_t(M) * N);
    StrideD stride_d = cute::make_stride(int64_t(N), cute::Int<1>{}, int64_t(M) * N);
    auto problem = cute::make_shape(M, N, K, 1);
    LayoutSFA layout_sfa = ScaleConfig::tile_atom_to_shape_SFA(problem);
    LayoutSFB layout_sfb = ScaleConfig::tile_atom_to_shape_SFB(problem);

    cutlass::KernelHardwareInfo hw_info;
    hw_info.device_id = 0;          // only used when sm_count <= 0 (then CUTLASS queries it)
    hw_info.sm_count = sm_count;

    // Without C, point the (never read, beta == 0) source at D so the C TMA descriptor stays valid.
    const ElementC* ptr_c = static_cast<const ElementC*>(c ? c : static_cast<const void*>(d));
    Arguments args{
        cutlass::gemm::GemmUniversalMode::kGemm,
        {M, N, K, 1},
        {static_cast<const ElementA*>(a), stride_a,
         static_cast<const ElementB*>(w), stride_b,
         static_cast<const ElementAccumulator*>(sfa), layout_sfa,
         static_cast<const ElementAccumulator*>(sfb), layout_sfb},
        {{}, ptr_c, stride_c, static_cast<ElementD*>(d), stride_d},
        hw_info};
    args.scheduler.max_swizzle_size = g_max_swizzle;
    args.scheduler.raster_order = static_cast<decltype(args.scheduler.raster_order)>(g_raster_order);
    args.epilogue.thread.alpha = 1.0f;
    args.epilogue.thread.beta = c ? 1.0f : 0.0f;
    args.epilogue.thread.alpha_ptr = nullptr;
    args.epilogue.thread.beta_ptr = nullptr;
    return args;
  }

  static int64_t workspace_size(int M, int N, int K) {
    if (M <= 0 || N <= 0 || K <= 0) return -int64_t(kErrBadShape);
    // Pointers do not matter for the size query; sm_count only bounds the persistent grid.
    int dev = 0;
    int sms = device_sm_count(&dev);
    Arguments args = make_args(nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, M, N, K, sms > 0 ? sms : 132);
    return int64_t(Gemm::get_workspace_size(args));
  }

  static int run(const void* a, const void* sfa, const void* w, const void* sfb, const void* c, void* d,
                 int M, int N, int K, void* workspace, size_t workspace_bytes, cudaStream_t stream) {
    g_detail[0] = 0;
    if (!a || !sfa || !w || !sfb || !d) { set_detail("null device pointer (a, ascale, w, wscale and out are required)"); return kErrNullPointer; }
    if (M <= 0 || N <= 0 || K <= 0 || K % kGroupK != 0 || N % 16 != 0) {
      char buf[160];
      std::snprintf(buf, sizeof(buf), "M=%d N=%d K=%d (need M >= 1, N %% 16 == 0, K %% 64 == 0)", M, N, K);
      set_detail("bad problem shape", buf);
      return kErrBadShape;
    }
    auto mis16 = [](const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15u) != 0; };
    auto mis4 = [](const void* p) { return (reinterpret_cast<uintptr_t>(p) & 3u) != 0; };
    if (mis16(a) || mis16(w) || mis16(d) || (c && mis16(c)) || mis4(sfa) || mis4(sfb)) {
      set_detail("misaligned pointer (a, w, c, out need 16-byte alignment; scales 4-byte)");
      return kErrMisaligned;
    }
    int dev = 0;
    int sms = device_sm_count(&dev);
    if (sms == 0) { set_detail("could not query the current CUDA device"); return kErrCuda; }
    if (sms < 0) { set_detail("current CUDA device is not compute capability 9.x (sm_90a kernel)"); return kErrNotSm90; }

    Arguments args = make_args(a, sfa, w, sfb, c, d, M, N, K, sms);
    args.hw_info.device_id = dev;
    Gemm gemm;
    cutlass::Status st = gemm.can_implement(args);
    if (st != cutlass::Status::kSuccess) { set_detail("can_implement", status_name(st)); return kErrCanImplement; }
    size_t need = Gemm::get_workspace_size(args);
    if (need > 0 && (workspace == nullptr || workspace_bytes < need)) {
      char buf[96];
      std::snprintf(buf, sizeof(buf), "need %zu bytes, got %zu", need, workspace == nullptr ? size_t(0) : workspace_bytes);
      set_detail("workspace too small", buf);
      return kErrWorkspaceTooSmall;
    }
    st = gemm.initialize(args, workspace, stream);
    if (st != cutlass::Status::kSuccess) {
      cudaError_t e = cudaGetLastError();
      set_detail(status_name(st), e != cudaSuccess ? cudaGetErrorString(e) : nullptr);
      return kErrInitialize;
    }
    st = gemm.run(stream);
    if (st != cutlass::Status::kSuccess) {
      cudaError_t e = cudaGetLastError();
      set_detail(status_name(st), e != cudaSuccess ? cudaGetErrorString(e) : nullptr);
      return kErrRun;
    }
    return kOk;
  }
};

// The configurations (tile M x N x 64, cluster, schedule). Each consumer thread holds two fp32
// accumulator fragments (the running sum and the per-group partial), so tiles whose per-warpgroup
// share exceeds 64x128 spill; see the Python module for the measured register counts.
using CfgCoop128x128 = Config<128, 128, 1, 1, true>;    // 2 consumer warpgroups, 64x128 each
using CfgPing64x128 = Config<64, 128, 1, 1, false>;     // 2 consumer warpgroups alternate 64x128 tiles
using CfgCoop128x128C2 = Config<128, 128, 2, 1, true>;  // cluster 2x1: W tile multicast to 2 CTAs

}  // namespace w4a4

// ---------------------------------------------------------------------------------------------
// C ABI
// ---------------------------------------------------------------------------------------------
#define W4A4_API extern "C" __attribute__((visibility("default")))
#define W4A4_ENTRY(NAME, CFG)                                                                          \
  W4A4_API int w4a4_cutlass_gemm_##NAME(const void* a, const void* sfa, const void* w, const void* sfb, \
                                          const void* c, void* d, int M, int N, int K, void* workspace,  \
                                          size_t workspace_bytes, void* stream) {                        \
    try {                                                                                              \
      return w4a4::CFG::run(a, sfa, w, sfb, c, d, M, N, K, workspace, workspace_bytes,                  \
                            static_cast<cudaStream_t>(stream));                                        \
    } catch (const std::exception& e) {                                                                \
      w4a4::set_detail("C++ exception", e.what());                                                     \
      return w4a4::kErrException;                                                                      \
    } catch (...) {                                                                                    \
      w4a4::set_detail("unknown C++ exception");                                                       \
      return w4a4::kErrException;                                                                      \
    }                                                                                                  \
  }                                                                                                    \
  W4A4_API int64_t w4a4_cutlass_workspace_##NAME(int M, int N, int K) {                              \
    try {                                                                                              \
      return w4a4::CFG::workspace_size(M, N, K);                                                       \
    } catch (...) {                                                                                    \
      return -int64_t(w4a4::kErrException);                                                            \
    }                                                                                                  \
  }

// W4A4_CONFIG_INDEX (the position in w4a4_cutlass_configs()) selects one config per translation unit
// for a parallel build; without it, one translation unit holds everything.
#if !defined(W4A4_CONFIG_INDEX) || W4A4_CONFIG_INDEX == 0
W4A4_ENTRY(coop_128x128, CfgCoop128x128)
#endif
#if !defined(W4A4_CONFIG_INDEX) || W4A4_CONFIG_INDEX == 1
W4A4_ENTRY(pingpong_64x128, CfgPing64x128)
#endif
#if !defined(W4A4_CONFIG_INDEX) || W4A4_CONFIG_INDEX == 2
W4A4_ENTRY(coop_128x128_c2x1, CfgCoop128x128C2)
#endif

#if !defined(W4A4_CONFIG_INDEX) || W4A4_CONFIG_INDEX == 0
W4A4_API const char* w4a4_cutlass_configs() { return "coop_128x128,pingpong_64x128,coop_128x128_c2x1"; }

W4A4_API int w4a4_cutlass_abi_version() { return 2; }

// Persistent tile scheduler options for all configs: max_swizzle in {1, 2, 4, 8}, raster_order 0
// (heuristic), 1 (along M) or 2 (along N). Returns 0, or kErrBadShape for other values.
W4A4_API int w4a4_cutlass_set_scheduler(int max_swizzle, int raster_order) {
  bool ok = (max_swizzle == 1 || max_swizzle == 2 || max_swizzle == 4 || max_swizzle == 8) &&
            raster_order >= 0 && raster_order <= 2;
  if (!ok) return w4a4::kErrBadShape;
  w4a4::g_max_swizzle = max_swizzle;
  w4a4::g_raster_order = raster_order;
  return w4a4::kOk;
}

W4A4_API const char* w4a4_cutlass_last_error_detail() { return w4a4::g_detail; }

W4A4_API const char* w4a4_cutlass_error_string(int code) {
  switch (code) {
    case w4a4::kOk: return "ok";
    case w4a4::kErrNullPointer: return "null device pointer";
    case w4a4::kErrBadShape: return "unsupported problem shape (need M >= 1, N % 16 == 0, K % 64 == 0)";
    case w4a4::kErrMisaligned: return "misaligned pointer (a, w, c, out: 16 bytes; scales: 4 bytes)";
    case w4a4::kErrNotSm90: return "current CUDA device is not Hopper (sm_90a kernel)";
    case w4a4::kErrCanImplement: return "CUTLASS can_implement() rejected the problem";
    case w4a4::kErrWorkspaceTooSmall: return "workspace missing or too small";
    case w4a4::kErrInitialize: return "CUTLASS initialize() failed";
    case w4a4::kErrRun: return "CUTLASS run() / kernel launch failed";
    case w4a4::kErrCuda: return "CUDA runtime error while querying the device";
    case w4a4::kErrException: return "C++ exception inside the CUTLASS wrapper";
    case w4a4::kErrNotCompiled: return "library compiled without sm_90a support";
    default: return "unknown error code";
  }
}
#endif

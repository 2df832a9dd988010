// What every jax_cgx FFI handler (xla_ffi/cpu_handlers.cc,
// xla_ffi/cuda_handlers.cc, the nccl and tcp backends' handlers) needs to check its
// arguments and report errors, in one wording:
//
//   "<target>: <buffer> has shape [3, 5], expected [R, 2] = [3, 2]"
//   "<target>: <buffer> has dtype int32, expected float32, bfloat16 or float16"
//   "<target>: attribute bits must be in 1..8, got 9"
//
// Bad arguments are INVALID_ARGUMENT errors, failures of the GPU or NCCL
// INTERNAL ones, both prefixed with the target's name; nothing aborts.
// Host-only (includes XLA's ffi.h); kernels use xla_ffi/float_type.h.
#ifndef JAX_CGX_XLA_FFI_FFI_SUPPORT_H_
#define JAX_CGX_XLA_FFI_FFI_SUPPORT_H_

#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <string>
#include <string_view>
#include <utility>

#include "xla/ffi/api/ffi.h"
#include "xla_ffi/codec_math.h"
#include "xla_ffi/float_type.h"

namespace jax_cgx::ffi_support {

namespace ffi = xla::ffi;
using Dims = ffi::Span<const int64_t>;

// The FFI targets' interface (operands, results, attributes) as this build implements it; the
// extensions export it as `interface_version`, and jax_cgx/_src/extensions.py refuses a build whose
// number differs from its own (a stale extension would fail every call on an unknown attribute).
// Bump both together whenever a target's signature changes. 2: `scale` on the decoding targets.
inline constexpr int kInterfaceVersion = 2;

// Returns from the enclosing function when `expr` (an ffi::Error) failed.
#define CGX_RETURN_IF_ERROR(expr)                  \
  do {                                             \
    ::xla::ffi::Error cgx_err_ = (expr);           \
    if (cgx_err_.failure()) return cgx_err_;       \
  } while (0)

// ------------------------------------------------------------------ errors

inline ffi::Error InvalidArgument(std::string_view target, const std::string& message) {
  return ffi::Error(ffi::ErrorCode::kInvalidArgument, std::string(target) + ": " + message);
}

inline ffi::Error Internal(std::string_view target, const std::string& message) {
  return ffi::Error(ffi::ErrorCode::kInternal, std::string(target) + ": " + message);
}

// ------------------------------------------------------------ descriptions

// "[3, 5]".
inline std::string ShapeString(const int64_t* dims, size_t rank) {
  std::string s = "[";
  for (size_t i = 0; i < rank; ++i) s += (i ? ", " : "") + std::to_string(dims[i]);
  return s + "]";
}
inline std::string ShapeString(Dims dims) { return ShapeString(dims.begin(), dims.size()); }
inline std::string ShapeString(std::initializer_list<int64_t> dims) {
  return ShapeString(dims.begin(), dims.size());
}

// NumPy's names ("int32", "bfloat16"), as JAX users see their dtypes.
inline std::string DTypeName(ffi::DataType t) {
  switch (t) {
    case ffi::DataType::PRED: return "bool";
    case ffi::DataType::S8: return "int8";
    case ffi::DataType::S16: return "int16";
    case ffi::DataType::S32: return "int32";
    case ffi::DataType::S64: return "int64";
    case ffi::DataType::U8: return "uint8";
    case ffi::DataType::U16: return "uint16";
    case ffi::DataType::U32: return "uint32";
    case ffi::DataType::U64: return "uint64";
    case ffi::DataType::F16: return "float16";
    case ffi::DataType::BF16: return "bfloat16";
    case ffi::DataType::F32: return "float32";
    case ffi::DataType::F64: return "float64";
    default: return "dtype code " + std::to_string(static_cast<int>(t));
  }
}

// ------------------------------------------------------------------ checks

// The codec's float types: F32, BF16, F16. The one mapping from XLA's dtypes.
inline bool ToFloatType(ffi::DataType t, FloatType* out) {
  switch (t) {
    case ffi::DataType::F32: *out = FloatType::kF32; return true;
    case ffi::DataType::BF16: *out = FloatType::kBF16; return true;
    case ffi::DataType::F16: *out = FloatType::kF16; return true;
    default: return false;
  }
}

// Buffer `name` must have one of the codec's float types; sets *out.
inline ffi::Error CheckFloatType(std::string_view target, const char* name, ffi::DataType t,
                                 FloatType* out) {
  if (ToFloatType(t, out)) return ffi::Error::Success();
  return InvalidArgument(target, std::string(name) + " has dtype " + DTypeName(t) +
                                     ", expected float32, bfloat16 or float16");
}

// Buffer `name` must have dtype `want`.
inline ffi::Error CheckDType(std::string_view target, const char* name, ffi::DataType t,
                             ffi::DataType want) {
  if (t == want) return ffi::Error::Success();
  return InvalidArgument(target, std::string(name) + " has dtype " + DTypeName(t) + ", expected " +
                                     DTypeName(want));
}

// Buffer `name` must have exactly the dims `want` (-1: any extent);
// `expected` describes them in the message.
inline ffi::Error CheckShape(std::string_view target, const char* name, Dims dims,
                             std::initializer_list<int64_t> want, const std::string& expected) {
  bool ok = dims.size() == want.size();
  for (size_t i = 0; ok && i < want.size(); ++i) {
    ok = want.begin()[i] < 0 || dims[i] == want.begin()[i];
  }
  if (ok) return ffi::Error::Success();
  return InvalidArgument(
      target, std::string(name) + " has shape " + ShapeString(dims) + ", expected " + expected);
}

// A rank-2 float buffer [R, n] (x, out): its FloatType and dimensions.
// `expected` names the dimensions ("[R, n]").
inline ffi::Error CheckFloatRows(std::string_view target, const char* name,
                                 const ffi::AnyBuffer& b, const char* expected, FloatType* type,
                                 int64_t* rows, int64_t* cols) {
  CGX_RETURN_IF_ERROR(CheckFloatType(target, name, b.element_type(), type));
  CGX_RETURN_IF_ERROR(
      CheckShape(target, name, b.dimensions(), {-1, -1}, std::string("rank 2 ") + expected));
  *rows = b.dimensions()[0];
  *cols = b.dimensions()[1];
  return ffi::Error::Success();
}

// The attributes of every codec target.
inline ffi::Error CheckCodecAttrs(std::string_view target, int32_t bits, int64_t bucket_size) {
  if (!valid_bits(bits)) {
    return InvalidArgument(target, "attribute bits must be in " + std::to_string(kMinBits) + ".." +
                                       std::to_string(kMaxBits) + ", got " + std::to_string(bits));
  }
  if (bucket_size < 1) {
    return InvalidArgument(
        target, "attribute bucket_size must be >= 1, got " + std::to_string(bucket_size));
  }
  return ffi::Error::Success();
}

// The output scale of the decoding targets (1, or 1/W for a mean): a positive
// finite float, so that it scales without changing any value's sign or class.
inline ffi::Error CheckOutScale(std::string_view target, float scale) {
  if (!(scale > 0.0f) || !(scale <= 3.4028234663852886e38f)) {
    return InvalidArgument(target, "attribute scale must be a positive finite float, got " + std::to_string(scale));
  }
  return ffi::Error::Success();
}

// valid: [R] counts (each row's elements that set its buckets' ranges) or
// [0] (all of them). Sets *per_row to whether the counts are given.
inline ffi::Error CheckValidShape(std::string_view target, Dims dims, int64_t rows, bool* per_row) {
  if (dims.size() != 1 || (dims[0] != rows && dims[0] != 0)) {
    return InvalidArgument(target, "valid has shape " + ShapeString(dims) + ", expected [R] = " +
                                       ShapeString({rows}) + " or [0] (every element valid)");
  }
  *per_row = dims[0] != 0;
  return ffi::Error::Success();
}

// addend: [R, m] (present) or [R, 0] (absent). Sets *present.
inline ffi::Error CheckAddendShape(std::string_view target, Dims dims, int64_t rows, int64_t m,
                                   bool* present) {
  if (dims.size() != 2 || dims[0] != rows || (dims[1] != m && dims[1] != 0)) {
    return InvalidArgument(target, "addend has shape " + ShapeString(dims) +
                                       ", expected [R, m] = " + ShapeString({rows, m}) +
                                       " or [R, 0] (no addend)");
  }
  *present = dims[1] == m;
  return ffi::Error::Success();
}

// meta [R, (W,) nb, 2] and payload [R, (W,) P] holding m elements per row
// (no W axis when inputs < 0); nb and P are the layout's bucket count and
// payload bytes per row for m elements at bits and bucket_size.
inline ffi::Error CheckPacked(std::string_view target, const char* payload_name, Dims payload_dims,
                              const char* meta_name, Dims meta_dims, int64_t rows, int64_t inputs,
                              int64_t m, int64_t nb, int64_t p, int64_t bucket_size, int32_t bits) {
  const std::string note = " (m = " + std::to_string(m) + ", bucket_size = " +
                           std::to_string(bucket_size) + ", bits = " + std::to_string(bits) + ")";
  if (inputs < 0) {
    CGX_RETURN_IF_ERROR(CheckShape(target, meta_name, meta_dims, {rows, nb, 2},
                                   "[R, nb, 2] = " + ShapeString({rows, nb, 2}) + note));
    return CheckShape(target, payload_name, payload_dims, {rows, p},
                      "[R, P] = " + ShapeString({rows, p}) + note);
  }
  CGX_RETURN_IF_ERROR(CheckShape(target, meta_name, meta_dims, {rows, inputs, nb, 2},
                                 "[R, W, nb, 2] = " + ShapeString({rows, inputs, nb, 2}) + note));
  return CheckShape(target, payload_name, payload_dims, {rows, inputs, p},
                    "[R, W, P] = " + ShapeString({rows, inputs, p}) + note);
}

// ------------------------------------------------- the codec targets' operands, once for every platform
//
// The CPU (xla_ffi/cpu_handlers.cc) and CUDA (xla_ffi/cuda_handlers.cc) handlers of the four codec
// targets take the same operands (xla_ffi/README.md) and check them here, each target with one call;
// they differ only in what they launch.

// What a codec target's operands say of the rows it works on.
struct CodecRows {
  int64_t rows = 0;                       // R
  int64_t n = 0;                          // quantize: values per row of x
  int64_t m = 0;                          // values encoded (decoded) per row
  int64_t inputs = -1;                    // the reduce targets: W encodings per row
  FloatType x_type = FloatType::kF32;     // quantize's x
  FloatType addend_type = FloatType::kF32;
  FloatType out_type = FloatType::kF32;   // the decoding targets' out
  const void* addend = nullptr;           // nullptr: no addend (or nothing to add)
  const int32_t* valid = nullptr;         // per-row real counts; nullptr: every value is real
};

// valid: s32 [R] counts (each row's values that set its buckets' ranges) or [0] (all of them).
inline ffi::Error CheckValidCounts(std::string_view target, const ffi::AnyBuffer& valid, CodecRows* r) {
  CGX_RETURN_IF_ERROR(CheckDType(target, "valid", valid.element_type(), ffi::DataType::S32));
  bool per_row = false;
  CGX_RETURN_IF_ERROR(CheckValidShape(target, valid.dimensions(), r->rows, &per_row));
  r->valid = per_row ? static_cast<const int32_t*>(valid.untyped_data()) : nullptr;
  return ffi::Error::Success();
}

// payload[R, (W,) P] u8 and meta[R, (W,) nb, 2] f32 holding r's m values per row at bits and
// bucket_size (the W axis only when `inputs` >= 0).
inline ffi::Error CheckEncodings(std::string_view target, const char* payload_name, const ffi::AnyBuffer& payload,
                                 const char* meta_name, const ffi::AnyBuffer& meta, int64_t rows, int64_t inputs,
                                 int64_t m, int32_t bits, int64_t bucket_size) {
  CGX_RETURN_IF_ERROR(CheckDType(target, payload_name, payload.element_type(), ffi::DataType::U8));
  CGX_RETURN_IF_ERROR(CheckDType(target, meta_name, meta.element_type(), ffi::DataType::F32));
  return CheckPacked(target, payload_name, payload.dimensions(), meta_name, meta.dimensions(), rows, inputs, m,
                     bucket_count(m, bucket_size), row_payload_bytes(m, bucket_size, bits), bucket_size, bits);
}

// jax_cgx_quantize: x[R, n] float, seeds[R, 2] u32, valid[R|0] s32 -> payload[R, P] u8, meta[R, nb, 2] f32.
// meta's bucket count nb picks m = min(n, nb * B): all of x (nb = ceil(n/B)) or whole buckets only.
inline ffi::Error CheckQuantizeOperands(std::string_view target, const ffi::AnyBuffer& x,
                                       const ffi::AnyBuffer& seeds, const ffi::AnyBuffer& valid,
                                       const ffi::AnyBuffer& payload, const ffi::AnyBuffer& meta, int32_t bits,
                                       int64_t bucket_size, CodecRows* r) {
  CGX_RETURN_IF_ERROR(CheckCodecAttrs(target, bits, bucket_size));
  CGX_RETURN_IF_ERROR(CheckFloatRows(target, "x", x, "[R, n]", &r->x_type, &r->rows, &r->n));
  CGX_RETURN_IF_ERROR(CheckDType(target, "seeds", seeds.element_type(), ffi::DataType::U32));
  CGX_RETURN_IF_ERROR(CheckShape(target, "seeds", seeds.dimensions(), {r->rows, 2}, "[R, 2] (R from x)"));
  CGX_RETURN_IF_ERROR(CheckValidCounts(target, valid, r));
  const Dims md = meta.dimensions();
  const int64_t max_nb = bucket_count(r->n, bucket_size);
  if (md.size() != 3 || md[0] != r->rows || md[2] != 2 || md[1] < 0 || md[1] > max_nb) {
    return InvalidArgument(target, "meta has shape " + ShapeString(md) + ", expected [R, nb, 2] with R = " +
                                       std::to_string(r->rows) + " and nb <= ceil(n/B) = " +
                                       std::to_string(max_nb) + " (n = " + std::to_string(r->n) +
                                       ", bucket_size = " + std::to_string(bucket_size) + ")");
  }
  r->m = md[1] == max_nb ? r->n : md[1] * bucket_size;  // nb < ceil(n/B): nb * B < n
  return CheckEncodings(target, "payload", payload, "meta", meta, r->rows, -1, r->m, bits, bucket_size);
}

// jax_cgx_dequantize: payload[R, P] u8, meta[R, nb, 2] f32 -> out[R, m] float; `scale` positive, finite.
inline ffi::Error CheckDequantizeOperands(std::string_view target, const ffi::AnyBuffer& payload,
                                         const ffi::AnyBuffer& meta, const ffi::AnyBuffer& out, int32_t bits,
                                         int64_t bucket_size, float scale, CodecRows* r) {
  CGX_RETURN_IF_ERROR(CheckCodecAttrs(target, bits, bucket_size));
  CGX_RETURN_IF_ERROR(CheckOutScale(target, scale));
  CGX_RETURN_IF_ERROR(CheckFloatRows(target, "out", out, "[R, m]", &r->out_type, &r->rows, &r->m));
  return CheckEncodings(target, "payload", payload, "meta", meta, r->rows, -1, r->m, bits, bucket_size);
}

// jax_cgx_dequantize_sum(_requantize)'s common operands: payload[R, W, P] u8, meta[R, W, nb, 2] f32,
// addend[R, m] or [R, 0] float -> out[R, m] float.
inline ffi::Error CheckSumOperands(std::string_view target, const ffi::AnyBuffer& payload,
                                   const ffi::AnyBuffer& meta, const ffi::AnyBuffer& addend,
                                   const ffi::AnyBuffer& out, int32_t bits, int64_t bucket_size, CodecRows* r) {
  CGX_RETURN_IF_ERROR(CheckCodecAttrs(target, bits, bucket_size));
  CGX_RETURN_IF_ERROR(CheckFloatRows(target, "out", out, "[R, m]", &r->out_type, &r->rows, &r->m));
  CGX_RETURN_IF_ERROR(CheckDType(target, "payload", payload.element_type(), ffi::DataType::U8));
  CGX_RETURN_IF_ERROR(CheckShape(target, "payload", payload.dimensions(), {r->rows, -1, -1}, "rank 3 [R, W, P]"));
  r->inputs = payload.dimensions()[1];
  CGX_RETURN_IF_ERROR(CheckFloatType(target, "addend", addend.element_type(), &r->addend_type));
  bool has_addend = false;
  CGX_RETURN_IF_ERROR(CheckAddendShape(target, addend.dimensions(), r->rows, r->m, &has_addend));
  r->addend = has_addend && r->m > 0 ? addend.untyped_data() : nullptr;
  return CheckEncodings(target, "payload", payload, "meta", meta, r->rows, r->inputs, r->m, bits, bucket_size);
}

// jax_cgx_dequantize_sum_requantize's own: seeds[R, 2] u32, valid[R|0] s32 -> the re-quantized
// payload[R, P] u8 and meta[R, nb, 2] f32 of out's m values (after CheckSumOperands).
inline ffi::Error CheckRequantizeOperands(std::string_view target, const ffi::AnyBuffer& seeds,
                                          const ffi::AnyBuffer& valid, const ffi::AnyBuffer& payload,
                                          const ffi::AnyBuffer& meta, int32_t bits, int64_t bucket_size,
                                          CodecRows* r) {
  CGX_RETURN_IF_ERROR(CheckDType(target, "seeds", seeds.element_type(), ffi::DataType::U32));
  CGX_RETURN_IF_ERROR(CheckShape(target, "seeds", seeds.dimensions(), {r->rows, 2}, "[R, 2] (R from out)"));
  CGX_RETURN_IF_ERROR(CheckValidCounts(target, valid, r));
  return CheckEncodings(target, "result payload", payload, "result meta", meta, r->rows, -1, r->m, bits,
                        bucket_size);
}

// Each codec target's signature in XLA's binding, written once: its operands, results and
// attributes, after whatever context a platform's handler takes first (CUDA: its stream). The CPU
// handlers bind `QuantizeSignature(ffi::Ffi::Bind())`, the CUDA ones the same after `.Ctx<...>()`;
// jax_cgx/_src/codec/kernels.py passes exactly these attributes (XLA rejects extra or missing ones).
template <typename Binding>
auto QuantizeSignature(Binding b) {  // x, seeds, valid -> payload, meta
  return std::move(b).template Arg<ffi::AnyBuffer>().template Arg<ffi::AnyBuffer>().template Arg<ffi::AnyBuffer>()
      .template Ret<ffi::AnyBuffer>().template Ret<ffi::AnyBuffer>()
      .template Attr<int32_t>("bits").template Attr<int64_t>("bucket_size").template Attr<bool>("stochastic");
}
template <typename Binding>
auto DequantizeSignature(Binding b) {  // payload, meta -> out; scale: 1, or 1/W for a mean
  return std::move(b).template Arg<ffi::AnyBuffer>().template Arg<ffi::AnyBuffer>().template Ret<ffi::AnyBuffer>()
      .template Attr<int32_t>("bits").template Attr<int64_t>("bucket_size").template Attr<float>("scale");
}
template <typename Binding>
auto DequantizeSumSignature(Binding b) {  // payload, meta, addend -> out
  return std::move(b).template Arg<ffi::AnyBuffer>().template Arg<ffi::AnyBuffer>().template Arg<ffi::AnyBuffer>()
      .template Ret<ffi::AnyBuffer>()
      .template Attr<int32_t>("bits").template Attr<int64_t>("bucket_size");
}
template <typename Binding>
auto DequantizeSumRequantizeSignature(Binding b) {  // payload, meta, addend, seeds, valid -> payload, meta, out
  return std::move(b).template Arg<ffi::AnyBuffer>().template Arg<ffi::AnyBuffer>().template Arg<ffi::AnyBuffer>()
      .template Arg<ffi::AnyBuffer>().template Arg<ffi::AnyBuffer>()
      .template Ret<ffi::AnyBuffer>().template Ret<ffi::AnyBuffer>().template Ret<ffi::AnyBuffer>()
      .template Attr<int32_t>("bits").template Attr<int64_t>("bucket_size").template Attr<bool>("stochastic");
}

// The row of a whole-exchange all-reduce (jax_cgx_nccl_allreduce,
// jax_cgx_tcp_allreduce_start): x[n] of a float type and out like it. Sets
// *type and *n. Their plan checks the attributes next (world >= 2 among them),
// then CheckRowSeeds checks what is shaped by world.
inline ffi::Error CheckRow(std::string_view target, const ffi::AnyBuffer& x, const ffi::AnyBuffer& out,
                           FloatType* type, int64_t* n) {
  CGX_RETURN_IF_ERROR(CheckFloatType(target, "x", x.element_type(), type));
  CGX_RETURN_IF_ERROR(CheckShape(target, "x", x.dimensions(), {-1}, "rank 1 [n] (one row)"));
  *n = x.dimensions()[0];
  CGX_RETURN_IF_ERROR(CheckDType(target, "out", out.element_type(), x.element_type()));
  return CheckShape(target, "out", out.dimensions(), {*n}, "[n] like x");
}

// seeds[W + 1, 2] u32 and valid[1] s32 of such a row.
inline ffi::Error CheckRowSeeds(std::string_view target, const ffi::AnyBuffer& seeds, const ffi::AnyBuffer& valid,
                                int64_t world) {
  CGX_RETURN_IF_ERROR(CheckDType(target, "seeds", seeds.element_type(), ffi::DataType::U32));
  CGX_RETURN_IF_ERROR(CheckShape(target, "seeds", seeds.dimensions(), {world + 1, 2}, "[world + 1, 2]"));
  CGX_RETURN_IF_ERROR(CheckDType(target, "valid", valid.element_type(), ffi::DataType::S32));
  return CheckShape(target, "valid", valid.dimensions(), {1}, "[1] (how many of x's values are real, the rest padding)");
}

}  // namespace jax_cgx::ffi_support

#endif  // JAX_CGX_XLA_FFI_FFI_SUPPORT_H_

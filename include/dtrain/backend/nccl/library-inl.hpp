#pragma once
/// @file
/// The non-template bodies of dtrain/backend/nccl/library.hpp: included by it in header-only
/// mode, compiled once in the library otherwise (DTRAIN_DETAIL_BODIES(),
/// dtrain/config.hpp). Include dtrain/backend/nccl/library.hpp, not this file.

#include <dtrain/backend/nccl/library.hpp>

#if DTRAIN_HAS_NCCL()
namespace dtrain::detail {

DTRAIN_DETAIL_INLINE std::string nccl_error_text(ncclResult_t code, const char* call,
                                                 const char* file, int line) {
  std::string text =
      "NCCL call `" + call_as_written(call) + "` failed: " + ncclGetErrorString(code);
  const char* last = ncclGetLastError(nullptr);
  if (last != nullptr && *last != '\0') text += std::string("; NCCL's last error: ") + last;
  return text + " (ncclResult_t " + std::to_string(static_cast<int>(code)) + ", at " + file + ":" +
         std::to_string(line) + ")";
}

}  // namespace dtrain::detail
#endif

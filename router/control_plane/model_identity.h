// ModelIdentity: the fingerprint every process of a cluster computes from its checkpoint
// directory, so the router can refuse a worker that loaded a different model.
//
// Cheap by design (no tensor data is read): FNV-1a 64 over
//   config_fingerprint:     the bytes of config.json;
//   checkpoint_fingerprint: for config.json and then each *.safetensors file in name order,
//                           the file name and, for config.json, its bytes; for a
//                           safetensors file, its 8-byte header length and JSON header
//                           (tensor names, dtypes, shapes, offsets).
// Each field is fed with its 8-byte little-endian length first, so concatenations cannot
// collide. Results are 16 lower-case hex digits. The values are opaque: compare them for
// equality only; a change of scheme changes every fingerprint.
#pragma once

#include <string>

#include "absl/status/statusor.h"
#include "dxs/v1/common.pb.h"

namespace dxs {

// NOT_FOUND when DIR/config.json is missing or unreadable; INVALID_ARGUMENT when a
// safetensors file is too short or its header length runs past the end of the file.
absl::StatusOr<v1::ModelFingerprint> ModelIdentity(const std::string& dir);

// The same function under the name the worker runtime uses.
inline absl::StatusOr<v1::ModelFingerprint> ComputeModelFingerprint(const std::string& dir) {
  return ModelIdentity(dir);
}

}  // namespace dxs

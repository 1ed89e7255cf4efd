// gRPC metadata keys of the dxs.v1 contract (each documented in its .proto file).
#pragma once

namespace dxs {

// AttentionWorker.Serve: the initial metadata with which a worker accepts the stream
// (value "1"), sent before any event so that the router knows the stream is served.
inline constexpr char kServeAcceptedMetadataKey[] = "dxs-serve-accepted";

}  // namespace dxs

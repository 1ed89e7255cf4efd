// Timeouts and waits that more than one file relies on, each named once with the reason
// for its value. A wait that only one file uses is a named constant in that file.
#pragma once

#include "absl/time/time.h"

namespace dxs {

// A step exchange that waits longer than this for a peer fails the step with UNAVAILABLE.
// The attention workers' --step-timeout-ms default (DispatchOptions::timeout). The expert
// workers have no such flag and use it as their bound on a round's receive and on the
// delivery of its combine: by then the attention side has failed the step itself. 5 s: a
// healthy exchange takes milliseconds, a long prefill included, so only a dead or frozen
// peer reaches it, and requests caught by one still fail within seconds.
inline constexpr absl::Duration kDefaultStepTimeout = absl::Seconds(5);

// How long a worker's main loop waits on its transport while it cannot serve (no cluster
// view yet, or an incomplete cluster) before it looks again. A new view or a message ends the
// wait at once, so this only bounds how late a change without either is noticed; 50 ms keeps
// an idle worker's wake-ups at 20 a second.
inline constexpr absl::Duration kWorkerIdleWait = absl::Milliseconds(50);

// The longest one turn of a worker's serving loop (an attention step, an expert round) waits
// for work before returning to the main loop, which between turns follows new views, readiness
// and heartbeats. A turn with work returns as soon as it is done, so 100 ms only bounds how
// late an idle worker reacts, and an expert that found no round for that long counts as idle.
inline constexpr absl::Duration kWorkerServeTurn = absl::Milliseconds(100);

// The pause before a failed step runs again: the placement or view that lets it succeed takes
// a moment to arrive, and ends the pause at once when it does. 20 ms retries about 50 times
// a second while nothing changes, cheap next to a step.
inline constexpr absl::Duration kStepRetryPause = absl::Milliseconds(20);

}  // namespace dxs

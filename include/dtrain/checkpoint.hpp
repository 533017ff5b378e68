#pragma once
/// @file
/// dtrain::checkpoint: one step's state of every rank saved consistently, and
/// resumed from (docs/checkpoints.md).
///
/// ```cpp
/// #include <dtrain/checkpoint.hpp>
/// dtrain::checkpoint ckpt(ctx, {.dir = "ckpt", .every = 100});
/// ```
///
/// Not included by dtrain.hpp: header-only, it would add about 0.8 s to every
/// translation unit that includes dtrain (its file system and thread code),
/// and only the file with the training loop needs it. The single header has
/// it. Its non-template functions are in dtrain's compiled part
/// (dtrain/runtime/compiled.hpp): the CMake libraries define them
/// (src/core.cpp); by hand, the TU with DTRAIN_COMPILED_DEFINITIONS=1 must
/// include this header too when any TU of the program does.

#include <dtrain/checkpoint/checkpoint.hpp>
#include <dtrain/checkpoint/format.hpp>

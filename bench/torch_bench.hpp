#pragma once
// What bench/torch_ddp and bench/torch_gpu share: the LibTorch CNN's loop
// settings (the model, the rounds, DDP's bucket caps) and their flags.

#include "train_program.hpp"

#include <cstdint>
#include <string_view>

namespace cnn {

/// The example's model (examples/torch_cnn.hpp) and how a benchmark times it;
/// each program sets its own rounds and caps.
struct loop_settings {
  std::int64_t batch_size = 32;
  std::int64_t channels = 16;
  std::int64_t hidden = 128;
  int steps = 20;
  int warmup = 3;
  int rounds = 9;
  double bucket_cap_mb = 25;
  double first_bucket_cap_mb = 1;
};

/// Reads one of loop_settings' flags (--batch-size, --channels, --hidden,
/// --steps, --warmup, --rounds, --bucket-cap-mb, --first-bucket-cap-mb) into
/// `s`; false for another flag. For mlp::command_line::each_flag's handler.
template <class Value>
bool read_loop_flag(const mlp::command_line& line, loop_settings& s, std::string_view flag,
                    Value& value) {
  if (flag == "--batch-size") {
    s.batch_size = line.number<std::int64_t>(flag, value(), 1);
  } else if (flag == "--channels") {
    s.channels = line.number<std::int64_t>(flag, value(), 2);
  } else if (flag == "--hidden") {
    s.hidden = line.number<std::int64_t>(flag, value(), 1);
  } else if (flag == "--steps") {
    s.steps = line.number<int>(flag, value(), 1);
  } else if (flag == "--warmup") {
    s.warmup = line.number<int>(flag, value(), 0);
  } else if (flag == "--rounds") {
    s.rounds = line.number<int>(flag, value(), 1);
  } else if (flag == "--bucket-cap-mb") {
    s.bucket_cap_mb = line.number<double>(flag, value(), 0.0);
  } else if (flag == "--first-bucket-cap-mb") {
    s.first_bucket_cap_mb = line.number<double>(flag, value(), 0.0);
  } else {
    return false;
  }
  return true;
}

}  // namespace cnn

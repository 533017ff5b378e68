#pragma once
/// @file
/// What the MLP demos (examples/train_mlp.cpp and examples/train_mlp_cuda.cu)
/// share as programs:
///
/// - their command line: the flags they share, parsed and described once.
///   Each program adds its own flags (--nproc-per-node, --min-accuracy)
///   through command_line::parse and their help through command_line's
///   constructor. --help prints the usage and exits 0; a bad flag or value
///   exits 2 (dtrain::config_error_exit_status) with a line that names it;
/// - their last check, that every rank ends with the same weights;
/// - the checkpoint flags, which the LibTorch example (train_torch.cpp) takes too.
///
/// Compiles with g++ and with nvcc -std=c++20.

#include <dtrain/dtrain.hpp>

#include <bit>
#include <charconv>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <system_error>
#include <vector>

namespace mlp {

/// What both demos train with; the defaults are those --help prints.
struct settings {
  std::size_t epochs = 5;
  std::size_t batch_size = 32;  // per rank
  double lr = 0.05;
  double momentum = 0.9;
  std::size_t samples = 8192;
  std::uint64_t seed = 1;
  std::size_t features = 32;
  std::size_t classes = 8;
  std::size_t hidden = 64;
  std::size_t depth = 2;              // hidden layers
  std::optional<int> nproc_per_node;  // the node agent's option (per-node launch only)

  /// The model's layer widths: features, `depth` hidden layers of `hidden`, classes.
  [[nodiscard]] std::vector<std::size_t> widths() const {
    std::vector<std::size_t> w{features};
    w.insert(w.end(), depth, hidden);
    w.push_back(classes);
    return w;
  }
  /// "32-64-64-8"
  [[nodiscard]] std::string widths_text() const {
    std::string text;
    for (std::size_t w : widths()) {
      if (!text.empty()) text += '-';
      text += std::to_string(w);
    }
    return text;
  }
};

/// The shared flags' synopsis (a program's own synopsis goes on from its end)
/// and their descriptions (a program's own follow).
inline constexpr const char* shared_synopsis =
    " [--epochs N] [--batch-size N] [--lr X] [--momentum X] [--samples N]\n"
    "          [--seed N] [--features N] [--classes N] [--hidden N] [--depth N]";
inline constexpr const char* shared_options =
    "  --epochs N          passes over the training set (5)\n"
    "  --batch-size N      samples per step on each rank (32)\n"
    "  --lr X              SGD learning rate (0.05)\n"
    "  --momentum X        SGD momentum (0.9)\n"
    "  --samples N         training samples; a quarter as many again for testing (8192)\n"
    "  --seed N            seeds the data, the weights and the shuffling (1)\n"
    "  --features N, --classes N   the problem's size (32, 8)\n"
    "  --hidden N, --depth N       the model: N hidden layers of that width (64, 2); a wide\n"
    "                      model (--features 1024 --hidden 1024) is compute-bound, the\n"
    "                      default one communication-bound\n";

/// One program's command line: its name (for messages) and the help of its
/// own flags, `synopsis` after shared_synopsis, `options` after shared_options.
class command_line {
 public:
  command_line(std::string_view program, const char* synopsis, const char* options)
      : program_(program), synopsis_(synopsis), options_(options) {}

  [[noreturn]] void bad_flag(const std::string& message) const {
    std::fprintf(stderr, "%s: %s (see --help)\n", program_.data(), message.c_str());
    std::exit(dtrain::config_error_exit_status);
  }

  template <class T>
  T number(std::string_view flag, std::string_view text, T least) const {
    T value{};
    auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), value);
    if (ec != std::errc() || end != text.data() + text.size() || value < least) {
      bad_flag(std::string(flag) + " " + std::string(text) + ": expected a number of at least " +
               std::to_string(least));
    }
    return value;
  }

  /// Walks argv: `--help` / `-h` prints `usage` and exits 0; a launcher's
  /// `--local_rank` is skipped; every other flag goes to handle(flag, value),
  /// which returns whether it took the flag (otherwise: exit 2, naming it).
  /// value() reads the flag's value (`--flag=V` or the next argument; exits 2
  /// when missing). A flag taken without reading its value is a switch, and
  /// `--switch=V` exits 2.
  template <class Handle>
  void each_flag(int argc, char** argv, const std::string& usage, Handle handle) const {
    for (int i = 1; i < argc; ++i) {
      std::string_view arg = argv[i];
      if (arg == "--help" || arg == "-h") {
        std::printf("%s", usage.c_str());
        std::exit(0);
      }
      // A launcher's --local_rank=N / --local-rank N is for dtrain's world discovery.
      if (arg.starts_with("--local_rank=") || arg.starts_with("--local-rank=")) continue;
      if (arg == "--local_rank" || arg == "--local-rank") {
        ++i;
        continue;
      }
      std::string_view flag = arg, text;
      bool inline_value = false;
      if (auto eq = arg.find('='); arg.starts_with("--") && eq != std::string_view::npos) {
        flag = arg.substr(0, eq);
        text = arg.substr(eq + 1);
        inline_value = true;
      }
      bool read = false;
      auto value = [&]() -> std::string_view {
        read = true;
        if (inline_value) return text;
        if (i + 1 >= argc) bad_flag(std::string(flag) + " needs a value");
        return argv[++i];
      };
      if (!handle(flag, value)) bad_flag("unknown flag " + std::string(arg));
      // A switch (a flag the handler took without its value) given one: --no-overlap=0.
      if (inline_value && !read)
        bad_flag(std::string(flag) + " takes no value: " + std::string(arg));
    }
  }

  /// Reads argv into `s`. A flag that is not a shared one goes to
  /// own(flag, value), which returns whether it took the flag; value() reads
  /// the flag's value (`--flag=V` or the next argument; exits 2 when missing).
  template <class Own>
  void parse(int argc, char** argv, settings& s, Own own) const {
    const std::string usage = "usage: " + std::string(program_) + shared_synopsis + synopsis_ +
                              "\n" + shared_options + options_;
    each_flag(argc, argv, usage, [&](std::string_view flag, auto& value) {
      if (flag == "--epochs") {
        s.epochs = number<std::size_t>(flag, value(), 1);
      } else if (flag == "--batch-size") {
        s.batch_size = number<std::size_t>(flag, value(), 1);
      } else if (flag == "--lr") {
        s.lr = number<double>(flag, value(), 0.0);
      } else if (flag == "--momentum") {
        s.momentum = number<double>(flag, value(), 0.0);
      } else if (flag == "--samples") {
        s.samples = number<std::size_t>(flag, value(), 4);
      } else if (flag == "--seed") {
        s.seed = number<std::uint64_t>(flag, value(), 0);
      } else if (flag == "--features") {
        s.features = number<std::size_t>(flag, value(), 1);
      } else if (flag == "--classes") {
        s.classes = number<std::size_t>(flag, value(), 2);
      } else if (flag == "--hidden") {
        s.hidden = number<std::size_t>(flag, value(), 1);
      } else if (flag == "--depth") {
        s.depth = number<std::size_t>(flag, value(), 1);
      } else {
        return own(flag, value);
      }
      return true;
    });
    if (s.momentum >= 1.0) {
      bad_flag("--momentum " + std::to_string(s.momentum) + ": must be below 1");
    }
  }

 private:
  std::string_view program_;  // a literal's view: data() is null-terminated
  const char* synopsis_;
  const char* options_;
};

/// The checkpoint flags that the demo and the LibTorch example share; their
/// help is checkpoint_help (each program's synopsis names them).
inline constexpr const char* checkpoint_help =
    "  --checkpoint-dir DIR  resume from DIR's newest checkpoint on start, and save\n"
    "                      checkpoints there (every rank must see DIR)\n"
    "  --checkpoint-every N  save a checkpoint every N steps (0: never; 0)\n"
    "  --memory-every N    also save into memory every N steps (the memory tier: a\n"
    "                      worker restarted on its node resumes from there, and\n"
    "                      loses at most N steps; under dtrun) (0: never; 0)\n"
    "  --memory-budget X   copy as often as keeps the copies within this share of\n"
    "                      the step time (e.g. 0.03), at most every --memory-every\n"
    "                      steps (checkpoint_options::memory_budget) (0: none)\n";

struct checkpoint_flags {
  std::string dir;
  std::uint64_t every = 0;
  std::uint64_t memory_every = 0;
  double memory_budget = 0;

  /// Takes `flag` when it is one of these, reading its value(): whether it did.
  template <class Value>
  bool take(const command_line& line, std::string_view flag, Value& value) {
    if (flag == "--checkpoint-dir") {
      dir = std::string(value());
      if (dir.empty()) line.bad_flag("--checkpoint-dir needs a directory");
    } else if (flag == "--checkpoint-every") {
      every = line.number<std::uint64_t>(flag, value(), 0);
    } else if (flag == "--memory-every") {
      memory_every = line.number<std::uint64_t>(flag, value(), 0);
    } else if (flag == "--memory-budget") {
      memory_budget = line.number<double>(flag, value(), 0.0);
      if (!(memory_budget < 1)) line.bad_flag("--memory-budget: a share below 1, e.g. 0.03");
    } else {
      return false;
    }
    return true;
  }

  /// Once every flag is read: a flag that needs another it lacks, by name (exit 2).
  void check(const command_line& line) const {
    if (every > 0 && dir.empty()) {
      line.bad_flag("--checkpoint-every " + std::to_string(every) +
                    " needs a --checkpoint-dir to save into");
    }
    if (memory_every > 0 && dir.empty()) {
      line.bad_flag("--memory-every " + std::to_string(memory_every) +
                    " needs a --checkpoint-dir (the disk tier, its fallback)");
    }
    if (memory_budget > 0 && memory_every < 3) {
      line.bad_flag(
          "--memory-budget needs --memory-every N, N at least 3: the most steps "
          "between copies");
    }
  }
};

/// The end of a data-parallel run: `checksums` holds every rank's weight
/// checksum (mlp::checksum's bits), by rank. The main rank prints that they
/// agree, or to stderr which ranks differ from rank 0. Returns whether they agree.
inline bool weights_agree(std::string_view program, bool is_main,
                          std::span<const std::int64_t> checksums) {
  std::string differing;
  for (std::size_t r = 1; r < checksums.size(); ++r) {
    if (checksums[r] != checksums[0]) {
      differing += ' ';  // (not " " + to_string: GCC 12's -Wrestrict misfires on it at -O3)
      differing += std::to_string(r);
    }
  }
  if (is_main) {
    const auto rank0 = static_cast<unsigned long long>(std::bit_cast<std::uint64_t>(checksums[0]));
    if (differing.empty()) {
      std::printf("all %zu ranks hold identical weights (checksum %016llx)\n", checksums.size(),
                  rank0);
    } else {
      std::fprintf(stderr,
                   "%s: the ranks' weights differ after training: ranks%s do not match rank 0 "
                   "(checksum %016llx)\n",
                   program.data(), differing.c_str(), rank0);
    }
  }
  return differing.empty();
}

}  // namespace mlp

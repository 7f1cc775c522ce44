// dt::Options: one schema for every setting of an app (Boost.Program_options underneath).
//
// Each option has a dotted name ("train.steps"), a default, an optional range or choice list and
// a help line; --help prints them all. Values come from the command line (--train.steps=10) and
// from an INI file given with --config (section [train], key steps=10); the command line wins.
// Options are spelt out in full (no prefix is taken for an option). In a file, '#' or ';' first
// on a line, and '#' after a space or tab, start a comment; any other '#' belongs to the value.
// Anything unknown, mistyped or out of range throws dt::ConfigError naming the option, the
// source (command line or file path) and what was expected. Parsing allocates no rank resources,
// so apps parse before MPI starts and exit with code 2 on a ConfigError.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace dt {

class Options {
 public:
  Options(std::string program, std::string summary);
  ~Options();
  Options(const Options&) = delete;
  Options& operator=(const Options&) = delete;

  Options& add(const std::string& name, std::string* target, std::string def, std::string help,
               std::vector<std::string> choices = {});
  Options& add(const std::string& name, bool* target, bool def, std::string help);
  /// A setting of two words, `words.first` for true and `words.second` for false, held as a bool.
  Options& add(const std::string& name, bool* target, bool def, std::string help,
               const std::pair<std::string, std::string>& words);
  Options& add(const std::string& name, long* target, long def, std::string help,
               std::optional<long> min = std::nullopt, std::optional<long> max = std::nullopt);
  Options& add(const std::string& name, int* target, int def, std::string help,
               std::optional<int> min = std::nullopt, std::optional<int> max = std::nullopt);
  Options& add(const std::string& name, double* target, double def, std::string help,
               std::optional<double> min = std::nullopt, std::optional<double> max = std::nullopt);

  /// Marks the option added last as node-local: its value may differ between the ranks of one
  /// job (a path, a port, a device on the rank's own node).
  Options& node_local();
  /// The names of the node-local options, in the order they were added.
  std::vector<std::string> node_local_options() const;

  /// Parses argv (argv[0] is skipped). Returns false when --help was given (help already printed
  /// to stdout); true when targets hold the settings. Throws dt::ConfigError on any bad input.
  bool parse(int argc, const char* const* argv);
  /// Whether the last parse() took option `name` from the command line or the config file (not
  /// its default).
  bool given(const std::string& name) const;
  /// The --help text.
  std::string help() const;
  /// The usage line of the --help text, after "usage: " (default: "PROGRAM [--config FILE]
  /// [--section.key=value ...]"), for a program that also takes arguments of its own.
  Options& usage(const std::string& line);
  /// "name = value" lines of every option as parsed, for run logs, and a config file that reads
  /// back as the same settings: a value with a line break, a tab, a comment (" #"), spaces at
  /// its ends or a quote first is written in double quotes with \\, \", \n, \r and \t escaped.
  std::string dump() const;
  /// A value as dump() writes it, read back: one in double quotes unquoted and unescaped, any
  /// other as it is. Throws dt::ConfigError for an unknown escape or a quote left open.
  static std::string unquote(const std::string& value);

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

/// Runs `body` and maps a ConfigError to "PROGRAM: error: ..." on stderr and exit code 2. The
/// message goes out in one write, so that the lines of ranks failing together do not interleave;
/// with `quiet` it is not printed at all (the exit code stays 2): for the ranks that share what
/// the error can come from with a rank that prints it (see quiet_option_errors). A quiet rank
/// returns after 2 s: mpiexec ends the job at the first non-zero exit, and would otherwise kill
/// the reporting rank before it printed the error.
int run_with_config_errors(const char* program, const std::function<int()>& body,
                           bool quiet = false);

/// The rank the launcher gave this process before MPI starts (OMPI_COMM_WORLD_RANK, PMIX_RANK,
/// PMI_RANK or SLURM_PROCID, the first that is set and a number); -1 when none is.
int launcher_rank();

/// `s` made safe to print on a terminal (text read from a file, a damaged one, say): each control
/// byte (below a space, or DEL) but a tab, each byte of a C1 control (U+0080..U+009F, which some
/// terminals obey), and each byte that is not part of well-formed UTF-8, written as \xHH; the
/// rest (UTF-8 text) as it is.
std::string printable(const std::string& s);

/// This process's rank among the job's ranks on its node, as the launcher gave it before MPI
/// starts (OMPI_COMM_WORLD_LOCAL_RANK, MPI_LOCALRANKID or SLURM_LOCALID); -1 when none is set.
int launcher_local_rank();

/// The `quiet` of run_with_config_errors for a program started with argv, so that an option error
/// is printed once where every rank sees the same input. Without --config the input is the command
/// line, which every rank shares: only the launcher's rank 0 prints. A config file is read on each
/// rank's node and may differ between nodes: the first rank of each node prints (local rank 0),
/// and a rank whose local rank is not known prints too. In an MPMD launch of Open MPI (mpirun A :
/// B) each program has a command line of its own: the first rank of each prints as well.
bool quiet_option_errors(int argc, const char* const* argv);

/// Whether argv names a config file (--config FILE or --config=FILE), which each node reads for
/// itself.
bool config_file_given(int argc, const char* const* argv);

/// "64M", "1.5G", "8", "2GiB", "16KB", "1T": bytes with an optional binary K, M, G or T suffix
/// (also with B or iB, in any case), a fraction of a unit rounded down to whole bytes. Throws
/// dt::ConfigError "option --OPTION: 'TEXT' is not a size ..." for anything else, and for a value
/// above 2^64 - 1; the caller checks its own range.
std::uint64_t parse_size(const std::string& option, const std::string& text);

/// Makes folder `dir` (with its parents) where it is missing and checks that this process may
/// write there; throws dt::ConfigError naming `option` ("--trace.dir") and the reason otherwise.
void ensure_writable_dir(const std::string& option, const std::string& dir);

/// Whether this process can make a file in folder `dir`, by making one (a new name of its own,
/// no link followed) and removing it: 0, or the errno of the failure (EACCES, EROFS, ENOSPC,
/// EDQUOT, ENOENT...). What permission bits alone do not say (root on a read-only mount, a file
/// system out of inodes) is found too.
int file_creation_error(const std::string& dir);

}  // namespace dt

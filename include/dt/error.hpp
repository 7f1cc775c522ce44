// dt error types and the two kinds of checks.
//
// DT_CHECK(Type, cond, parts...)  bad user input: throws Type naming the input; parts are streamed.
// DT_CHECK_EQ/NE/LT/LE/GT/GE(Type, a, b, parts...)  same, and prints both operand values.
// DT_ASSERT(cond, parts...)       broken invariant (a bug in dt): throws dt::InternalError.
// Every error carries file:line of the check that raised it.
#pragma once

#include <sstream>
#include <stdexcept>
#include <string>
#include <utility>

namespace dt {

/// Base of every error dt throws. what() reads "message (file:line)".
class Error : public std::runtime_error {
 public:
  Error(const std::string& msg, const char* file, int line);
  /// The message without the source location.
  const std::string& message() const noexcept { return msg_; }

 private:
  std::string msg_;
};

/// A setting, option or config file is wrong. Apps exit with code 2.
class ConfigError : public Error {
  using Error::Error;
};
/// A communication call failed, timed out, or was given inconsistent buffers.
class CommError : public Error {
  using Error::Error;
};
/// A checkpoint cannot be written, read or trusted.
class CheckpointError : public Error {
  using Error::Error;
};
/// Authentication, key or integrity failure.
class SecurityError : public Error {
  using Error::Error;
};
/// A dt invariant is broken: this is a bug in dt, never in the input.
class InternalError : public Error {
  using Error::Error;
};
/// An argument violates a function's contract (wrong dtype, size, index).
class InvalidArgument : public Error {
  using Error::Error;
};

/// The message of any exception: a dt::Error's without its source location, else what().
inline std::string message_of(const std::exception& e) {
  if (const auto* de = dynamic_cast<const Error*>(&e)) return de->message();
  return e.what();
}

namespace detail {
template <class... Parts>
std::string concat(Parts&&... parts) {
  std::ostringstream os;
  ((os << std::forward<Parts>(parts)), ...);
  return os.str();
}
template <class E, class... Parts>
[[noreturn]] void raise(const char* file, int line, Parts&&... parts) {
  throw E(concat(std::forward<Parts>(parts)...), file, line);
}
template <class E, class... Parts>
[[noreturn]] void raise_check(const char* file, int line, const char* cond, Parts&&... parts) {
  if constexpr (sizeof...(Parts) == 0)
    throw E(std::string("check failed: ") + cond, file, line);
  else
    throw E(concat(std::forward<Parts>(parts)...), file, line);
}
}  // namespace detail

}  // namespace dt

#define DT_THROW(Type, ...) ::dt::detail::raise<Type>(__FILE__, __LINE__, __VA_ARGS__)

#define DT_CHECK(Type, cond, ...)                                                           \
  do {                                                                                      \
    if (!(cond)) ::dt::detail::raise_check<Type>(__FILE__, __LINE__, #cond, ##__VA_ARGS__); \
  } while (0)

#define DT_CHECK_OP_(Type, op, a, b, ...)                                                       \
  do {                                                                                          \
    const auto& dt_a_ = (a);                                                                    \
    const auto& dt_b_ = (b);                                                                    \
    if (!(dt_a_ op dt_b_))                                                                      \
      ::dt::detail::raise<Type>(__FILE__, __LINE__, ##__VA_ARGS__,                              \
                                " [expected " #a " " #op " " #b ", got ", dt_a_, " vs ", dt_b_, \
                                "]");                                                           \
  } while (0)

#define DT_CHECK_EQ(Type, a, b, ...) DT_CHECK_OP_(Type, ==, a, b, ##__VA_ARGS__)
#define DT_CHECK_NE(Type, a, b, ...) DT_CHECK_OP_(Type, !=, a, b, ##__VA_ARGS__)
#define DT_CHECK_LT(Type, a, b, ...) DT_CHECK_OP_(Type, <, a, b, ##__VA_ARGS__)
#define DT_CHECK_LE(Type, a, b, ...) DT_CHECK_OP_(Type, <=, a, b, ##__VA_ARGS__)
#define DT_CHECK_GT(Type, a, b, ...) DT_CHECK_OP_(Type, >, a, b, ##__VA_ARGS__)
#define DT_CHECK_GE(Type, a, b, ...) DT_CHECK_OP_(Type, >=, a, b, ##__VA_ARGS__)

#define DT_ASSERT(cond, ...)                                                               \
  do {                                                                                     \
    if (!(cond))                                                                           \
      ::dt::detail::raise<::dt::InternalError>(__FILE__, __LINE__, "internal: " #cond " ", \
                                               ##__VA_ARGS__);                             \
  } while (0)

// Job keys, HKDF and AES-256-GCM (OpenSSL's EVP, or Intel ipsec-mb where dt was built with it).
#include <fcntl.h>
#include <openssl/core_names.h>
#include <openssl/crypto.h>
#include <openssl/err.h>
#include <openssl/evp.h>
#include <openssl/kdf.h>
#include <openssl/params.h>
#include <openssl/rand.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <utility>

#include "dt/error.hpp"
#include "dt/security.hpp"

#ifdef DT_HAVE_IPSEC_MB
#include <intel-ipsec-mb.h>
#endif

namespace dt::security {

namespace {

std::string openssl_error() {
  const unsigned long e = ERR_get_error();
  if (e == 0) return "no OpenSSL error queued";
  char buf[256];
  ERR_error_string_n(e, buf, sizeof buf);
  return buf;
}

std::string octal_mode(mode_t m) {
  char buf[8];
  std::snprintf(buf, sizeof buf, "%04o", static_cast<unsigned>(m & 07777));
  return buf;
}

EVP_CIPHER_CTX* cctx(void* p) { return static_cast<EVP_CIPHER_CTX*>(p); }

}  // namespace

SecretKey::~SecretKey() { OPENSSL_cleanse(k_.data(), k_.size()); }

int open_private_file(const std::string& option, const std::string& path, struct stat* st) {
  // O_NONBLOCK: a FIFO planted at the path fails the regular-file check below instead of
  // blocking the rank in open() (for a regular file it changes nothing).
  const int fd = ::open(path.c_str(), O_RDONLY | O_NOFOLLOW | O_CLOEXEC | O_NONBLOCK);
  if (fd < 0 && errno == ELOOP)
    DT_THROW(ConfigError, option, ": '", path,
             "' is a symbolic link: a key file is never opened through a link (one could lead "
             "elsewhere); give the file itself");
  if (fd < 0) DT_THROW(ConfigError, option, ": cannot open '", path, "': ", std::strerror(errno));
  try {
    if (::fstat(fd, st) != 0)
      DT_THROW(ConfigError, option, ": cannot stat '", path, "': ", std::strerror(errno));
    DT_CHECK(ConfigError, S_ISREG(st->st_mode), option, ": '", path, "' is not a regular file");
    DT_CHECK(ConfigError, st->st_uid == ::geteuid(), option, ": '", path, "' is owned by uid ",
             st->st_uid, ", not by this job's user (uid ", ::geteuid(),
             "); the file must belong to the job's user");
    DT_CHECK(ConfigError, (st->st_mode & 077) == 0, option, ": '", path, "' has mode ",
             octal_mode(st->st_mode),
             ": group and others must have no access (chmod 600 or 400 the file)");
  } catch (...) {
    ::close(fd);
    throw;
  }
  return fd;
}

SecretKey load_key_file(const std::string& path) {
  struct stat st {};
  const int fd = open_private_file("security.key_file", path, &st);
  struct FdCloser {
    int fd;
    ~FdCloser() { ::close(fd); }
  } closer{fd};
  DT_CHECK(ConfigError, st.st_size == static_cast<off_t>(kKeyBytes), "security.key_file: '", path,
           "' holds ", st.st_size, " bytes; a job key is exactly ", kKeyBytes,
           " random bytes (head -c 32 /dev/urandom)");
  Key k{};
  std::size_t got = 0;
  while (got < k.size()) {
    const ssize_t r = ::read(fd, k.data() + got, k.size() - got);
    if (r < 0 && errno == EINTR) continue;
    if (r <= 0) {
      OPENSSL_cleanse(k.data(), k.size());
      DT_THROW(ConfigError, "security.key_file: cannot read '", path,
               "': ", r < 0 ? std::strerror(errno) : "file shorter than 32 bytes");
    }
    got += static_cast<std::size_t>(r);
  }
  SecretKey out(k);
  OPENSSL_cleanse(k.data(), k.size());
  return out;
}

std::pair<std::string, std::string> load_basic_auth_file(const std::string& option,
                                                         const std::string& path) {
  struct stat st {};
  const int fd = open_private_file(option, path, &st);
  std::string text(4097, '\0');
  // The password is wiped however this ends (a refused file too).
  struct Wipe {
    std::string& s;
    ~Wipe() { OPENSSL_cleanse(&s[0], s.size()); }
  } wipe{text};
  std::size_t got = 0;
  for (;;) {
    const ssize_t r = ::read(fd, &text[got], text.size() - got);
    if (r < 0 && errno == EINTR) continue;
    if (r <= 0) break;
    got += static_cast<std::size_t>(r);
    if (got == text.size()) break;
  }
  ::close(fd);
  text.resize(got);
  DT_CHECK(ConfigError, got < 4097, option, ": '", path, "' is longer than 4096 bytes");
  if (!text.empty() && text.back() == '\n') text.pop_back();
  if (!text.empty() && text.back() == '\r') text.pop_back();
  const std::size_t colon = text.find(':');
  DT_CHECK(ConfigError,
           colon != std::string::npos && colon > 0 && text.find('\n') == std::string::npos, option,
           ": '", path,
           "' must hold one line USER:PASSWORD (the Pushgateway's basic authentication)");
  return {text.substr(0, colon), text.substr(colon + 1)};
}

std::string slurm_job_id() {
  const char* v = std::getenv("SLURM_JOB_ID");
  return v && *v ? std::string(v) : std::string("none");
}

const Salt* detail::salt_for_test = nullptr;

Salt random_salt() {
  if (detail::salt_for_test) return *detail::salt_for_test;
  Salt s{};
  DT_CHECK(SecurityError, RAND_bytes(s.data(), static_cast<int>(s.size())) == 1,
           "RAND_bytes failed: ", openssl_error());
  return s;
}

Key hkdf_sha256(const std::uint8_t* ikm, std::size_t ikm_len, const std::uint8_t* salt,
                std::size_t salt_len, const std::uint8_t* info, std::size_t info_len) {
  EVP_KDF* kdf = EVP_KDF_fetch(nullptr, "HKDF", nullptr);
  DT_CHECK(SecurityError, kdf != nullptr, "HKDF is not available in OpenSSL: ", openssl_error());
  EVP_KDF_CTX* ctx = EVP_KDF_CTX_new(kdf);
  EVP_KDF_free(kdf);
  DT_CHECK(SecurityError, ctx != nullptr, "EVP_KDF_CTX_new failed: ", openssl_error());
  struct Free {
    EVP_KDF_CTX* c;
    ~Free() { EVP_KDF_CTX_free(c); }
  } free_ctx{ctx};
  char digest[] = "SHA256";
  OSSL_PARAM params[5];
  int k = 0;
  params[k++] = OSSL_PARAM_construct_utf8_string(OSSL_KDF_PARAM_DIGEST, digest, 0);
  params[k++] = OSSL_PARAM_construct_octet_string(OSSL_KDF_PARAM_KEY,
                                                  const_cast<std::uint8_t*>(ikm), ikm_len);
  params[k++] = OSSL_PARAM_construct_octet_string(OSSL_KDF_PARAM_SALT,
                                                  const_cast<std::uint8_t*>(salt), salt_len);
  params[k++] = OSSL_PARAM_construct_octet_string(OSSL_KDF_PARAM_INFO,
                                                  const_cast<std::uint8_t*>(info), info_len);
  params[k] = OSSL_PARAM_construct_end();
  Key out{};
  DT_CHECK(SecurityError, EVP_KDF_derive(ctx, out.data(), out.size(), params) == 1,
           "HKDF derivation failed: ", openssl_error());
  return out;
}

std::string to_hex(const std::uint8_t* p, std::size_t n) {
  static const char kDigits[] = "0123456789abcdef";
  std::string s;
  s.reserve(2 * n);
  for (std::size_t i = 0; i < n; ++i) {
    s.push_back(kDigits[p[i] >> 4]);
    s.push_back(kDigits[p[i] & 15]);
  }
  return s;
}

std::string key_fingerprint(const SecretKey& key) {
  static const char kLabel[] = "dt key fingerprint v1";  // salt and info (OpenSSL needs a salt)
  const auto* label = reinterpret_cast<const std::uint8_t*>(kLabel);
  Key d = hkdf_sha256(key.bytes().data(), key.bytes().size(), label, sizeof kLabel - 1, label,
                      sizeof kLabel - 1);
  const std::string hex = to_hex(d.data(), 8);
  OPENSSL_cleanse(d.data(), d.size());
  return hex;
}

Keys::Keys(SecretKey job_key, std::string job_id, AesImpl aes)
    : job_key_(std::move(job_key)), job_id_(std::move(job_id)), aes_(resolve_aes_impl(aes)) {
  DT_CHECK(ConfigError, aes_impl_available(aes_), "AES-256-GCM code '", aes_impl_name(aes_),
           "': ", ipsec_mb_unavailable(), " (expected auto or openssl)");
}

namespace {
void put_u32(std::string& s, std::uint32_t v) {
  for (int i = 0; i < 4; ++i) s.push_back(static_cast<char>((v >> (8 * i)) & 0xFF));
}
SecretKey derive(const SecretKey& ikm, const std::string& salt, const std::string& info) {
  Key k = hkdf_sha256(ikm.bytes().data(), ikm.bytes().size(),
                      reinterpret_cast<const std::uint8_t*>(salt.data()), salt.size(),
                      reinterpret_cast<const std::uint8_t*>(info.data()), info.size());
  SecretKey out(k);
  OPENSSL_cleanse(k.data(), k.size());
  return out;
}
}  // namespace

SecretKey Keys::traffic_key(const std::string& channel, const Salt& sender_salt,
                            const Salt& receiver_salt, int sender, int receiver) const {
  DT_CHECK(InvalidArgument,
           sender >= 0 && sender <= kMaxRank && receiver >= 0 && receiver <= kMaxRank,
           "sealed traffic between ranks ", sender, " and ", receiver, ": ranks above ", kMaxRank,
           " are not supported");
  // info = "dt/seal/v2" 0 sender-salt receiver-salt channel-length channel sender receiver:
  // unambiguous.
  std::string info = "dt/seal/v2";
  info.push_back('\0');
  info.append(reinterpret_cast<const char*>(sender_salt.data()), sender_salt.size());
  info.append(reinterpret_cast<const char*>(receiver_salt.data()), receiver_salt.size());
  put_u32(info, static_cast<std::uint32_t>(channel.size()));
  info += channel;
  put_u32(info, static_cast<std::uint32_t>(sender));
  put_u32(info, static_cast<std::uint32_t>(receiver));
  return derive(job_key_, "dt/job/" + job_id_, info);
}

SecretKey Keys::checkpoint_key(const Salt& file_salt) const {
  return derive(job_key_,
                std::string(reinterpret_cast<const char*>(file_salt.data()), file_salt.size()),
                "dt/ckpt/v1");
}

// ---- which AES-GCM code ---------------------------------------------------------------------

namespace {

#ifdef DT_HAVE_IPSEC_MB
// One manager for the process, set up once and only read afterwards: the GCM functions of the
// direct API are pointers in it that keep no state of their own (each call has its own context).
// `mgr` is null when it could not be set up (`why` says why). `wide`: its code for this CPU
// uses VAES and VPCLMULQDQ.
struct Imb {
  IMB_MGR* mgr = nullptr;
  IMB_ARCH arch = IMB_ARCH_NONE;
  bool wide = false;
  std::string why;
};
const Imb& imb() {
  static const Imb m = [] {
    Imb i;
    i.mgr = alloc_mb_mgr(0);
    if (!i.mgr) {
      i.why = "ipsec-mb could not allocate its manager";
      return i;
    }
    init_mb_mgr_auto(i.mgr, &i.arch);
    if (const int e = imb_get_errno(i.mgr); e != 0 || i.arch == IMB_ARCH_NONE) {
      i.why = std::string("ipsec-mb could not set up its manager for this CPU: ") +
              (e != 0 ? imb_get_strerror(e) : "no code path chosen");
      free_mb_mgr(i.mgr);
      i.mgr = nullptr;
      return i;
    }
    constexpr std::uint64_t kWide = IMB_FEATURE_VAES | IMB_FEATURE_VPCLMULQDQ;
    i.wide = (i.mgr->features & kWide) == kWide;
    return i;
  }();
  return m;
}
const char* arch_name(IMB_ARCH a) {
  switch (a) {
    case IMB_ARCH_NOAESNI:
      return "noaesni";
    case IMB_ARCH_SSE:
      return "sse";
    case IMB_ARCH_AVX:
      return "avx";
    case IMB_ARCH_AVX2:
      return "avx2";
    case IMB_ARCH_AVX512:
      return "avx512";
    default:
      return "";
  }
}
constexpr std::size_t kImbKeyBytes = (sizeof(gcm_key_data) + 63) / 64 * 64;
gcm_key_data* imb_key(void* p) { return static_cast<gcm_key_data*>(p); }
#endif

}  // namespace

const char* aes_impl_name(AesImpl a) noexcept {
  switch (a) {
    case AesImpl::automatic:
      return "auto";
    case AesImpl::openssl:
      return "openssl";
    case AesImpl::ipsec_mb:
      return "ipsec-mb";
  }
  return "?";
}

AesImpl parse_aes_impl(const std::string& text, const std::string& what) {
  for (const AesImpl a : {AesImpl::automatic, AesImpl::openssl, AesImpl::ipsec_mb})
    if (text == aes_impl_name(a)) return a;
  DT_THROW(ConfigError, what, "='", text, "': expected auto, openssl or ipsec-mb");
}

bool aes_impl_available(AesImpl a) noexcept {
  return a != AesImpl::ipsec_mb || ipsec_mb_unavailable().empty();
}

std::string ipsec_mb_unavailable() {
#ifdef DT_HAVE_IPSEC_MB
  return imb().why;
#else
  return "this build of dt has no ipsec-mb (build dt with the Debian package libipsec-mb-dev "
         "installed)";
#endif
}

AesImpl resolve_aes_impl(AesImpl a) noexcept {
  if (a != AesImpl::automatic) return a;
#ifdef DT_HAVE_IPSEC_MB
  // Its AVX-512 code with VAES and VPCLMULQDQ (Ice Lake and later, Zen 4 and later) runs several
  // times faster than OpenSSL 3.0's AES-NI code; without them (Skylake-SP, older CPUs) the two are
  // alike, and OpenSSL stays.
  if (imb().mgr && imb().arch == IMB_ARCH_AVX512 && imb().wide) return AesImpl::ipsec_mb;
#endif
  return AesImpl::openssl;
}

std::string ipsec_mb_arch() {
#ifdef DT_HAVE_IPSEC_MB
  if (imb().mgr) return std::string(arch_name(imb().arch)) + (imb().wide ? "+vaes" : "");
#endif
  return "";
}

// ---- Aead ---------------------------------------------------------------------------------------

Aead::Aead(const SecretKey& key, bool encrypt, AesImpl impl) : encrypt_(encrypt) {
  impl = resolve_aes_impl(impl);
  if (impl == AesImpl::ipsec_mb) {
#ifdef DT_HAVE_IPSEC_MB
    DT_CHECK(SecurityError, imb().mgr != nullptr, "AES-256-GCM code 'ipsec-mb': ", imb().why);
    void* k = std::aligned_alloc(64, kImbKeyBytes);
    DT_CHECK(SecurityError, k != nullptr, "AES-256-GCM set-up: out of memory");
    IMB_AES256_GCM_PRE(imb().mgr, key.bytes().data(), imb_key(k));
    imb_ = k;
    return;
#else
    DT_THROW(SecurityError, "AES-256-GCM code 'ipsec-mb': ", ipsec_mb_unavailable(),
             " (expected auto or openssl)");
#endif
  }
  EVP_CIPHER_CTX* c = EVP_CIPHER_CTX_new();
  DT_CHECK(SecurityError, c != nullptr, "EVP_CIPHER_CTX_new failed: ", openssl_error());
  ctx_ = c;
  const int ok =
      encrypt ? EVP_EncryptInit_ex(c, EVP_aes_256_gcm(), nullptr, key.bytes().data(), nullptr)
              : EVP_DecryptInit_ex(c, EVP_aes_256_gcm(), nullptr, key.bytes().data(), nullptr);
  if (ok != 1) {
    EVP_CIPHER_CTX_free(c);
    ctx_ = nullptr;
    DT_THROW(SecurityError, "AES-256-GCM set-up failed: ", openssl_error());
  }
}

void Aead::release() noexcept {
  if (ctx_) EVP_CIPHER_CTX_free(cctx(ctx_));
  ctx_ = nullptr;
#ifdef DT_HAVE_IPSEC_MB
  if (imb_) {
    OPENSSL_cleanse(imb_, kImbKeyBytes);  // the expanded key and the hash key's powers
    std::free(imb_);
  }
#endif
  imb_ = nullptr;
}

Aead::~Aead() { release(); }

Aead::Aead(Aead&& o) noexcept
    : ctx_(std::exchange(o.ctx_, nullptr)),
      imb_(std::exchange(o.imb_, nullptr)),
      encrypt_(o.encrypt_) {}

Aead& Aead::operator=(Aead&& o) noexcept {
  if (this != &o) {
    release();
    ctx_ = std::exchange(o.ctx_, nullptr);
    imb_ = std::exchange(o.imb_, nullptr);
    encrypt_ = o.encrypt_;
  }
  return *this;
}

namespace {
// EVP takes int lengths: feed large buffers in pieces.
constexpr std::size_t kEvpPiece = std::size_t{1} << 30;
// GCM's 32-bit block counter covers 2^32 - 2 blocks under one nonce (NIST SP 800-38D): past
// that the keystream would repeat. OpenSSL refuses more; ipsec-mb does not check.
constexpr std::uint64_t kGcmMaxBytes = (std::uint64_t{1} << 36) - 32;
}  // namespace

void Aead::check_call(bool sealing, std::size_t n) const {
  DT_ASSERT((ctx_ != nullptr || imb_ != nullptr) && encrypt_ == sealing,
            sealing ? "seal on a moved-from or decrypting Aead"
                    : "open on a moved-from or encrypting Aead");
  DT_CHECK(SecurityError, n <= kGcmMaxBytes, "AES-256-GCM: ", n,
           " bytes under one nonce is more than GCM allows (", kGcmMaxBytes, ")");
}

void Aead::seal(const std::uint8_t* nonce, const std::uint8_t* aad, std::size_t aad_len,
                const void* in, std::size_t n, void* out, std::uint8_t* tag) {
  check_call(true, n);
  const auto* src = static_cast<const std::uint8_t*>(in);
  auto* dst = static_cast<std::uint8_t*>(out);
#ifdef DT_HAVE_IPSEC_MB
  if (imb_) {
    gcm_context_data gc;
    IMB_AES256_GCM_ENC(imb().mgr, imb_key(imb_), &gc, dst, src, n, nonce, aad, aad_len, tag,
                       kTagBytes);
    OPENSSL_cleanse(&gc, sizeof gc);
    return;
  }
#endif
  EVP_CIPHER_CTX* c = cctx(ctx_);
  int len = 0;
  DT_CHECK(SecurityError, EVP_EncryptInit_ex(c, nullptr, nullptr, nullptr, nonce) == 1,
           "AES-GCM nonce set-up failed: ", openssl_error());
  DT_CHECK(SecurityError,
           aad_len == 0 || EVP_EncryptUpdate(c, nullptr, &len, aad, static_cast<int>(aad_len)) == 1,
           "AES-GCM AAD failed: ", openssl_error());
  for (std::size_t off = 0; off < n; off += kEvpPiece) {
    const int piece = static_cast<int>(std::min(kEvpPiece, n - off));
    DT_CHECK(SecurityError, EVP_EncryptUpdate(c, dst + off, &len, src + off, piece) == 1,
             "AES-GCM encryption failed: ", openssl_error());
  }
  DT_CHECK(SecurityError, EVP_EncryptFinal_ex(c, dst + n, &len) == 1,
           "AES-GCM finalisation failed: ", openssl_error());
  DT_CHECK(SecurityError,
           EVP_CIPHER_CTX_ctrl(c, EVP_CTRL_GCM_GET_TAG, static_cast<int>(kTagBytes), tag) == 1,
           "AES-GCM tag failed: ", openssl_error());
}

bool Aead::open(const std::uint8_t* nonce, const std::uint8_t* aad, std::size_t aad_len,
                const void* in, std::size_t n, void* out, const std::uint8_t* tag) {
  check_call(false, n);
  const auto* src = static_cast<const std::uint8_t*>(in);
  auto* dst = static_cast<std::uint8_t*>(out);
#ifdef DT_HAVE_IPSEC_MB
  if (imb_) {
    gcm_context_data gc;
    std::uint8_t t[kTagBytes];
    IMB_AES256_GCM_DEC(imb().mgr, imb_key(imb_), &gc, dst, src, n, nonce, aad, aad_len, t,
                       kTagBytes);
    OPENSSL_cleanse(&gc, sizeof gc);
    const bool ok = CRYPTO_memcmp(t, tag, kTagBytes) == 0;
    OPENSSL_cleanse(t, sizeof t);
    if (!ok) OPENSSL_cleanse(dst, n);
    return ok;
  }
#endif
  EVP_CIPHER_CTX* c = cctx(ctx_);
  int len = 0;
  DT_CHECK(SecurityError, EVP_DecryptInit_ex(c, nullptr, nullptr, nullptr, nonce) == 1,
           "AES-GCM nonce set-up failed: ", openssl_error());
  DT_CHECK(SecurityError,
           aad_len == 0 || EVP_DecryptUpdate(c, nullptr, &len, aad, static_cast<int>(aad_len)) == 1,
           "AES-GCM AAD failed: ", openssl_error());
  // A failure after a piece was decrypted leaves no byte that was not authenticated in `out`.
  auto fail = [&](const char* what) {
    const std::string why = openssl_error();
    OPENSSL_cleanse(dst, n);
    DT_THROW(SecurityError, what, why);
  };
  for (std::size_t off = 0; off < n; off += kEvpPiece) {
    const int piece = static_cast<int>(std::min(kEvpPiece, n - off));
    if (EVP_DecryptUpdate(c, dst + off, &len, src + off, piece) != 1)
      fail("AES-GCM decryption failed: ");
  }
  std::uint8_t t[kTagBytes];
  std::memcpy(t, tag, kTagBytes);
  if (EVP_CIPHER_CTX_ctrl(c, EVP_CTRL_GCM_SET_TAG, static_cast<int>(kTagBytes), t) != 1)
    fail("AES-GCM tag set-up failed: ");
  const bool ok = EVP_DecryptFinal_ex(c, dst + n, &len) == 1;
  if (!ok) {
    ERR_clear_error();
    OPENSSL_cleanse(dst, n);
  }
  return ok;
}

}  // namespace dt::security

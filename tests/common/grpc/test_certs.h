// Test certificates made at test time with openssl: a cluster CA, a server certificate for
// 127.0.0.1/localhost, a client ("cluster member") certificate, and a second CA with its
// own client certificate (a stranger the cluster must not trust).
#pragma once

#include <cstdlib>
#include <fstream>
#include <string>

#include "absl/strings/str_cat.h"

namespace dxs::testing {

struct TestCerts {
  std::string dir;
  std::string ca() const { return dir + "/ca.pem"; }
  std::string server_cert() const { return dir + "/server.pem"; }
  std::string server_key() const { return dir + "/server.key"; }
  std::string client_cert() const { return dir + "/client.pem"; }
  std::string client_key() const { return dir + "/client.key"; }
  std::string stranger_cert() const { return dir + "/stranger.pem"; }
  std::string stranger_key() const { return dir + "/stranger.key"; }
};

// Writes the certificates into `dir`; false if openssl failed (its output: openssl.log).
inline bool MakeTestCerts(const std::string& dir, TestCerts* out) {
  out->dir = dir;
  const std::string script = R"(set -e
exec >openssl.log 2>&1
printf 'subjectAltName=IP:127.0.0.1,DNS:localhost\n' > san.ext
for ca in ca otherca; do
  openssl req -x509 -newkey rsa:2048 -nodes -days 2 -subj "/CN=dxs-$ca" -keyout $ca.key -out $ca.pem
done
issue() {  # name ca cn [extfile]
  openssl req -newkey rsa:2048 -nodes -subj "/CN=$3" -keyout $1.key -out $1.csr
  openssl x509 -req -in $1.csr -CA $2.pem -CAkey $2.key -CAcreateserial -days 2 -out $1.pem ${4:+-extfile $4}
}
issue server ca localhost san.ext
issue client ca dxs-worker
issue stranger otherca stranger
)";
  std::ofstream(dir + "/make_certs.sh") << script;
  return std::system(absl::StrCat("cd '", dir, "' && bash make_certs.sh").c_str()) == 0;
}

}  // namespace dxs::testing

"""A preload shim that makes getnameinfo() numeric, for the benchmarks that run torch's TCPStore.

torch formats every peer address with getnameinfo(), a reverse DNS lookup per connect and accept (10 s for
100 ranks with this machine's resolver): the benchmarks' torch processes preload this shim so that the
resolver is not what is measured."""

from __future__ import annotations

import os
import subprocess

SOURCE = r"""
#define _GNU_SOURCE
#include <dlfcn.h>
#include <netdb.h>
int getnameinfo(const struct sockaddr *sa, socklen_t salen, char *host, socklen_t hostlen,
                char *serv, socklen_t servlen, int flags) {
    static int (*real)(const struct sockaddr *, socklen_t, char *, socklen_t, char *, socklen_t, int);
    if (!real) real = dlsym(RTLD_NEXT, "getnameinfo");
    return real(sa, salen, host, hostlen, serv, servlen, flags | NI_NUMERICHOST);
}
"""


def build(workdir: str) -> str:
    """Compile the shim in ``workdir``; the shared library's path. OSError or CalledProcessError without a
    C compiler."""
    src, lib = os.path.join(workdir, "numeric_getnameinfo.c"), os.path.join(workdir, "numeric_getnameinfo.so")
    with open(src, "w") as f:
        f.write(SOURCE)
    subprocess.run(["cc", "-shared", "-fPIC", "-O2", "-o", lib, src, "-ldl"], check=True, capture_output=True)
    return lib

/* libnccl.so.2 for CI without a GPU: every ncclXxx symbol that nccl4py 0.6.0 resolves, with NCCL 2.32.3's C
 * signatures (nccl.h of nvidia-nccl-cu13 2.32.3, the version nccl4py 0.6.0 was generated for; device-API ones from
 * nccl4py's cynccl.pxd). The real nccl4py binding loads this library instead of NVIDIA's, so its own argument
 * conversion and result handling run in CI; tests/simnccl/stublib.py builds and loads it, abi.py answers its calls.
 *
 * Each call goes to one of:
 *  - the simulation (simnccl installed in this process): the modelled functions call a handler that Python
 *    registered (simnccl_set); the others call the "unmodelled" handler, which raises in the binding's caller;
 *  - NVIDIA's libnccl (simnccl not installed): the call passes through unchanged to the library named by
 *    simnccl_passthrough, so that a process that preloaded this stub still reaches real NCCL when it wants it.
 *
 * Errors that are not NCCL's (a function the simulated NCCL version lacks, a simulation that refuses a call) reach
 * the binding's caller as Python exceptions: a handler arms one with simnccl_raise, and the call returns the value
 * nccl4py's declarations name as their exception value (cynccl.pxd: `except?_NCCLRESULT_T_INTERNAL_LOADING_ERROR`,
 * -42, for ncclResult_t; `except?NULL` for const char*; `except?-42` for int; `except*` for the rest), with the
 * exception set in the calling thread: nccl4py then raises it, as it raises its own FunctionNotFoundError.
 *
 * Build: cc -shared -fPIC (stublib.py). With -DSIMNCCL_CHECK_HEADER and nccl.h on the include path, NCCL's own
 * declarations are used instead of the ones below, so that a signature here that differs from NCCL's fails to
 * compile (tests/test_simnccl_conformance.py does that).
 */
#include <dlfcn.h>
#include <pthread.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#ifdef SIMNCCL_CHECK_HEADER
#include <nccl.h>
#else
typedef enum { ncclSuccess = 0, ncclSystemError = 2, ncclNumResults = 9 } ncclResult_t;
typedef struct ncclComm *ncclComm_t;
typedef struct ncclWindow_vidmem *ncclWindow_t;
typedef struct { char internal[128]; } ncclUniqueId;
typedef enum { ncclNumTypes = 12 } ncclDataType_t;
typedef enum { ncclNumOps = 5, ncclMaxRedOp = 0x7fffffff } ncclRedOp_t;
typedef enum { ncclScalarDevice = 0, ncclScalarHostImmediate = 1 } ncclScalarResidence_t;
typedef enum { ncclStatGpuMemSuspend = 0 } ncclCommMemStat_t;
typedef struct CUstream_st *cudaStream_t;
typedef struct ncclConfig_v23100 ncclConfig_t;
typedef struct ncclCollConfig_v23200 ncclCollConfig_t;
typedef struct ncclSimInfo_v22200 ncclSimInfo_t;
typedef struct ncclEncryptionConfig_v23200 ncclEncryptionConfig_t;
typedef struct ncclParamHandle *ncclParamHandle_t;
typedef struct { int opCnt; int peer; int sigIdx; int ctx; } ncclWaitSignalDesc_t;
#endif

/* The device API (nccl_device/host.h, C++): its by-value structs as nccl4py declares them. */
typedef struct { int nRanks; int rank; int stride; } ncclTeam_t;
typedef struct { void *mcBasePtr; } ncclMultimemHandle_t;
typedef int ncclCftTeamMode_t;
typedef uint32_t ncclCftLeId;
typedef struct ncclCommProperties ncclCommProperties_t;
typedef struct ncclDevComm ncclDevComm_t;
typedef struct ncclDevCommRequirements ncclDevCommRequirements_t;
typedef struct ncclDevResourceRequirements ncclDevResourceRequirements_t;
typedef struct ncclLsaBarrierHandle ncclLsaBarrierHandle_t;
typedef struct ncclGinBarrierHandle ncclGinBarrierHandle_t;
typedef struct ncclLLA2AHandle ncclLLA2AHandle_t;

#define LOADING_ERROR ((ncclResult_t)-42) /* nccl4py's _NCCLRESULT_T_INTERNAL_LOADING_ERROR */

/* --- the Python side: exceptions raised in the binding's caller ------------------------------------------------ */

extern int PyGILState_Ensure(void);
extern void PyGILState_Release(int);
extern void PyErr_SetObject(void *type, void *value);
extern void *PyObject_Type(void *o);
extern void Py_IncRef(void *o);
extern void Py_DecRef(void *o);

static __thread void *pending; /* the exception this thread's current call raises */

/* Called from Python (through ctypes.PyDLL: the GIL is held) by a handler before it returns. */
void simnccl_raise(void *exc) {
  Py_IncRef(exc);
  if (pending) Py_DecRef(pending);
  pending = exc;
}

/* Moves an armed exception into the calling thread's Python error state; 1 if there was one. */
static int raised(void) {
  if (!pending) return 0;
  int gil = PyGILState_Ensure();
  void *type = PyObject_Type(pending);
  PyErr_SetObject(type, pending);
  Py_DecRef(type);
  Py_DecRef(pending);
  pending = NULL;
  PyGILState_Release(gil);
  return 1;
}

/* --- modes -------------------------------------------------------------------------------------------------- */

static volatile int simulated; /* 1: calls go to the simulation; 0: to the real library */
static void (*on_unmodelled)(const char *name);
static void (*on_missing)(const char *name);

int simnccl_mode(int on) {
  int was = simulated;
  simulated = on;
  return was;
}

static char real_path[4096];
static void *real_handle;
static pthread_mutex_t real_lock = PTHREAD_MUTEX_INITIALIZER;

/* The real libnccl for calls made while the simulation is not installed (opened RTLD_LOCAL on first use, so that
 * its symbols never shadow this library's). */
int simnccl_passthrough(const char *path) {
  if (strlen(path) >= sizeof(real_path)) return -1;
  pthread_mutex_lock(&real_lock);
  strcpy(real_path, path);
  pthread_mutex_unlock(&real_lock);
  return 0;
}

static void *real_symbol(const char *name) {
  pthread_mutex_lock(&real_lock);
  if (!real_handle && real_path[0]) real_handle = dlopen(real_path, RTLD_NOW | RTLD_LOCAL);
  void *handle = real_handle;
  pthread_mutex_unlock(&real_lock);
  return handle ? dlsym(handle, name) : NULL;
}

/* A call that neither the simulation nor a real library takes: the registered handler arms the exception. */
static int unavailable(const char *name) {
  if (simulated && on_unmodelled) on_unmodelled(name);
  else if (!simulated && on_missing) on_missing(name);
  return raised();
}

/* --- the functions ------------------------------------------------------------------------------------------- */

/* X(name, parameters, arguments): functions the simulation models, all returning ncclResult_t; their handlers
 * take the same arguments (ncclUniqueId by value arrives as a pointer to the caller's copy: *_ID below). */
#define MODELLED(X)                                                                                                   \
  X(ncclGetVersion, (int *version), (version))                                                                        \
  X(ncclGetUniqueId, (ncclUniqueId * uniqueId), (uniqueId))                                                           \
  X(ncclCommInitRankScalable, (ncclComm_t * newcomm, int nranks, int myrank, int nId, ncclUniqueId *commIds,          \
                               ncclConfig_t *config), (newcomm, nranks, myrank, nId, commIds, config))                \
  X(ncclCommFinalize, (ncclComm_t comm), (comm))                                                                      \
  X(ncclCommDestroy, (ncclComm_t comm), (comm))                                                                       \
  X(ncclCommAbort, (ncclComm_t comm), (comm))                                                                         \
  X(ncclCommRevoke, (ncclComm_t comm, int revokeFlags), (comm, revokeFlags))                                          \
  X(ncclCommSplit, (ncclComm_t comm, int color, int key, ncclComm_t *newcomm, ncclConfig_t *config),                 \
    (comm, color, key, newcomm, config))                                                                              \
  X(ncclCommShrink, (ncclComm_t comm, int *excludeRanksList, int excludeRanksCount, ncclComm_t *newcomm,             \
                     ncclConfig_t *config, int shrinkFlags),                                                          \
    (comm, excludeRanksList, excludeRanksCount, newcomm, config, shrinkFlags))                                        \
  X(ncclCommGetUniqueId, (ncclComm_t comm, ncclUniqueId * uniqueId), (comm, uniqueId))                               \
  X(ncclCommGrow, (ncclComm_t comm, int nRanks, const ncclUniqueId *uniqueId, int rank, ncclComm_t *newcomm,         \
                   ncclConfig_t *config), (comm, nRanks, uniqueId, rank, newcomm, config))                            \
  X(ncclCommGetAsyncError, (ncclComm_t comm, ncclResult_t * asyncError), (comm, asyncError))                          \
  X(ncclCommCount, (const ncclComm_t comm, int *count), (comm, count))                                                \
  X(ncclCommUserRank, (const ncclComm_t comm, int *rank), (comm, rank))                                               \
  X(ncclRedOpCreatePreMulSum, (ncclRedOp_t * op, void *scalar, ncclDataType_t datatype,                              \
                               ncclScalarResidence_t residence, ncclComm_t comm), (op, scalar, datatype, residence, comm)) \
  X(ncclRedOpDestroy, (ncclRedOp_t op, ncclComm_t comm), (op, comm))                                                 \
  X(ncclReduce, (const void *sendbuff, void *recvbuff, size_t count, ncclDataType_t datatype, ncclRedOp_t op,        \
                 int root, ncclComm_t comm, cudaStream_t stream), (sendbuff, recvbuff, count, datatype, op, root, comm, stream)) \
  X(ncclBroadcast, (const void *sendbuff, void *recvbuff, size_t count, ncclDataType_t datatype, int root,           \
                    ncclComm_t comm, cudaStream_t stream), (sendbuff, recvbuff, count, datatype, root, comm, stream))  \
  X(ncclAllReduce, (const void *sendbuff, void *recvbuff, size_t count, ncclDataType_t datatype, ncclRedOp_t op,     \
                    ncclComm_t comm, cudaStream_t stream), (sendbuff, recvbuff, count, datatype, op, comm, stream))    \
  X(ncclReduceScatter, (const void *sendbuff, void *recvbuff, size_t recvcount, ncclDataType_t datatype,             \
                        ncclRedOp_t op, ncclComm_t comm, cudaStream_t stream),                                        \
    (sendbuff, recvbuff, recvcount, datatype, op, comm, stream))                                                      \
  X(ncclAllGather, (const void *sendbuff, void *recvbuff, size_t sendcount, ncclDataType_t datatype, ncclComm_t comm, \
                    cudaStream_t stream), (sendbuff, recvbuff, sendcount, datatype, comm, stream))                    \
  X(ncclAlltoAll, (const void *sendbuff, void *recvbuff, size_t count, ncclDataType_t datatype, ncclComm_t comm,      \
                   cudaStream_t stream), (sendbuff, recvbuff, count, datatype, comm, stream))                         \
  X(ncclGather, (const void *sendbuff, void *recvbuff, size_t count, ncclDataType_t datatype, int root,              \
                 ncclComm_t comm, cudaStream_t stream), (sendbuff, recvbuff, count, datatype, root, comm, stream))     \
  X(ncclScatter, (const void *sendbuff, void *recvbuff, size_t count, ncclDataType_t datatype, int root,             \
                  ncclComm_t comm, cudaStream_t stream), (sendbuff, recvbuff, count, datatype, root, comm, stream))    \
  X(ncclSend, (const void *sendbuff, size_t count, ncclDataType_t datatype, int peer, ncclComm_t comm,               \
               cudaStream_t stream), (sendbuff, count, datatype, peer, comm, stream))                                 \
  X(ncclRecv, (void *recvbuff, size_t count, ncclDataType_t datatype, int peer, ncclComm_t comm, cudaStream_t stream), \
    (recvbuff, count, datatype, peer, comm, stream))                                                                  \
  X(ncclGroupStart, (void), ())                                                                                       \
  X(ncclGroupEnd, (void), ())                                                                                         \
  X(ncclCommSuspend, (ncclComm_t comm, int flags), (comm, flags))                                                      \
  X(ncclCommResume, (ncclComm_t comm), (comm))                                                                        \
  X(ncclCommMemStats, (ncclComm_t comm, ncclCommMemStat_t stat, uint64_t *value), (comm, stat, value))                \
  X(ncclAllReduceConfig, (const void *sendbuff, void *recvbuff, size_t count, ncclDataType_t datatype, ncclRedOp_t op, \
                          ncclComm_t comm, cudaStream_t stream, const ncclCollConfig_t *config),                      \
    (sendbuff, recvbuff, count, datatype, op, comm, stream, config))                                                  \
  X(ncclBroadcastConfig, (const void *sendbuff, void *recvbuff, size_t count, ncclDataType_t datatype, int root,      \
                          ncclComm_t comm, cudaStream_t stream, const ncclCollConfig_t *config),                      \
    (sendbuff, recvbuff, count, datatype, root, comm, stream, config))                                                \
  X(ncclReduceConfig, (const void *sendbuff, void *recvbuff, size_t count, ncclDataType_t datatype, ncclRedOp_t op,    \
                       int root, ncclComm_t comm, cudaStream_t stream, const ncclCollConfig_t *config),               \
    (sendbuff, recvbuff, count, datatype, op, root, comm, stream, config))                                            \
  X(ncclAllGatherConfig, (const void *sendbuff, void *recvbuff, size_t sendcount, ncclDataType_t datatype,             \
                          ncclComm_t comm, cudaStream_t stream, const ncclCollConfig_t *config),                      \
    (sendbuff, recvbuff, sendcount, datatype, comm, stream, config))                                                  \
  X(ncclReduceScatterConfig, (const void *sendbuff, void *recvbuff, size_t recvcount, ncclDataType_t datatype,         \
                              ncclRedOp_t op, ncclComm_t comm, cudaStream_t stream, const ncclCollConfig_t *config),  \
    (sendbuff, recvbuff, recvcount, datatype, op, comm, stream, config))                                              \
  X(ncclAlltoAllConfig, (const void *sendbuff, void *recvbuff, size_t count, ncclDataType_t datatype, ncclComm_t comm,  \
                         cudaStream_t stream, const ncclCollConfig_t *config),                                        \
    (sendbuff, recvbuff, count, datatype, comm, stream, config))                                                      \
  X(ncclGatherConfig, (const void *sendbuff, void *recvbuff, size_t count, ncclDataType_t datatype, int root,          \
                       ncclComm_t comm, cudaStream_t stream, const ncclCollConfig_t *config),                         \
    (sendbuff, recvbuff, count, datatype, root, comm, stream, config))                                                \
  X(ncclScatterConfig, (const void *sendbuff, void *recvbuff, size_t count, ncclDataType_t datatype, int root,         \
                        ncclComm_t comm, cudaStream_t stream, const ncclCollConfig_t *config),                        \
    (sendbuff, recvbuff, count, datatype, root, comm, stream, config))

#define DEFINE_MODELLED(name, params, args)                                                                           \
  static ncclResult_t(*sim_##name) params;                                                                            \
  static ncclResult_t(*real_##name) params;                                                                           \
  ncclResult_t name params {                                                                                          \
    ncclResult_t(*handler) params = sim_##name;                                                                       \
    if (simulated && handler) {                                                                                       \
      ncclResult_t r = handler args;                                                                                  \
      return raised() ? LOADING_ERROR : r;                                                                            \
    }                                                                                                                 \
    if (!simulated && (real_##name || (real_##name = real_symbol(#name)))) return real_##name args;                   \
    return unavailable(#name) ? LOADING_ERROR : ncclSystemError;                                                      \
  }
MODELLED(DEFINE_MODELLED)

/* ncclCommInitRankConfig takes the id by value: its handler gets a pointer to this call's copy. */
static ncclResult_t (*sim_ncclCommInitRankConfig)(ncclComm_t *, int, const ncclUniqueId *, int, ncclConfig_t *);
static ncclResult_t (*real_ncclCommInitRankConfig)(ncclComm_t *, int, ncclUniqueId, int, ncclConfig_t *);
ncclResult_t ncclCommInitRankConfig(ncclComm_t *comm, int nranks, ncclUniqueId commId, int rank, ncclConfig_t *config) {
  if (simulated && sim_ncclCommInitRankConfig) {
    ncclResult_t r = sim_ncclCommInitRankConfig(comm, nranks, &commId, rank, config);
    return raised() ? LOADING_ERROR : r;
  }
  if (!simulated && (real_ncclCommInitRankConfig || (real_ncclCommInitRankConfig = real_symbol("ncclCommInitRankConfig"))))
    return real_ncclCommInitRankConfig(comm, nranks, commId, rank, config);
  return unavailable("ncclCommInitRankConfig") ? LOADING_ERROR : ncclSystemError;
}

/* NCCL's texts (init.cc ncclGetErrorString, v2.30.7; the same in 2.32.3): static, as NCCL's are. No handler: the
 * binding's NCCLError calls this to build its message, also from inside the simulation. */
static const char *error_string(ncclResult_t code) {
  static const char *const text[ncclNumResults] = {
      "no error",
      "unhandled cuda error (run with NCCL_DEBUG=INFO for details)",
      "unhandled system error (run with NCCL_DEBUG=INFO for details)",
      "internal error - please report this issue to the NCCL developers",
      "invalid argument (run with NCCL_DEBUG=WARN for details)",
      "invalid usage (run with NCCL_DEBUG=WARN for details)",
      "remote process exited or there was a network error",
      "NCCL operation in progress",
      "timeout",
  };
  return (unsigned)code < ncclNumResults ? text[code] : "unknown result code";
}

static const char *(*real_ncclGetErrorString)(ncclResult_t);
const char *ncclGetErrorString(ncclResult_t result) {
  if (!simulated && (real_ncclGetErrorString || (real_ncclGetErrorString = real_symbol("ncclGetErrorString"))))
    return real_ncclGetErrorString(result);
  return error_string(result);
}

/* X(return type, return value, name, parameters, arguments): the functions the simulation does not model; with the
 * simulation installed they raise in the caller (the return value is then nccl4py's exception value). */
#define RESULT (raised_ ? LOADING_ERROR : ncclSystemError)
#define TEXT (raised_ ? NULL : "")
#define TEAM ((ncclTeam_t){0, 0, 0}) /* `except*`: nccl4py always looks for an exception */
#define INT (raised_ ? -42 : -1)
#define UNMODELLED(X)                                                                                                 \
  X(ncclResult_t, RESULT, ncclMemAlloc, (void **ptr, size_t size), (ptr, size))                                \
  X(ncclResult_t, RESULT, ncclMemFree, (void *ptr), (ptr))                                                     \
  X(ncclResult_t, RESULT, ncclCommInitRank, (ncclComm_t * comm, int nranks, ncclUniqueId commId, int rank),   \
    (comm, nranks, commId, rank))                                                                                     \
  X(ncclResult_t, RESULT, ncclCommInitAll, (ncclComm_t * comm, int ndev, const int *devlist),                 \
    (comm, ndev, devlist))                                                                                            \
  X(const char *, TEXT, ncclGetLastError, (ncclComm_t comm), (comm))                                                  \
  X(ncclResult_t, RESULT, ncclCommCuDevice, (const ncclComm_t comm, int *device), (comm, device))              \
  X(ncclResult_t, RESULT, ncclCommRegister, (const ncclComm_t comm, void *buff, size_t size, void **handle),  \
    (comm, buff, size, handle))                                                                                       \
  X(ncclResult_t, RESULT, ncclCommDeregister, (const ncclComm_t comm, void *handle), (comm, handle))           \
  X(ncclResult_t, RESULT, ncclCommWindowRegister,                                                              \
    (ncclComm_t comm, void *buff, size_t size, ncclWindow_t *win, int winFlags), (comm, buff, size, win, winFlags))   \
  X(ncclResult_t, RESULT, ncclCommWindowDeregister, (ncclComm_t comm, ncclWindow_t win), (comm, win))          \
  X(ncclResult_t, RESULT, ncclWinGetUserPtr, (ncclComm_t comm, ncclWindow_t win, void **outUserPtr),          \
    (comm, win, outUserPtr))                                                                                          \
  X(ncclResult_t, RESULT, ncclBcast,                                                                           \
    (void *buff, size_t count, ncclDataType_t datatype, int root, ncclComm_t comm, cudaStream_t stream),              \
    (buff, count, datatype, root, comm, stream))                                                                      \
  X(ncclResult_t, RESULT, ncclPutSignal,                                                                       \
    (const void *localbuff, size_t count, ncclDataType_t datatype, int peer, ncclWindow_t peerWin,                    \
     size_t peerWinOffset, int sigIdx, int ctx, unsigned int flags, ncclComm_t comm, cudaStream_t stream),            \
    (localbuff, count, datatype, peer, peerWin, peerWinOffset, sigIdx, ctx, flags, comm, stream))                     \
  X(ncclResult_t, RESULT, ncclSignal,                                                                          \
    (int peer, int sigIdx, int ctx, unsigned int flags, ncclComm_t comm, cudaStream_t stream),                        \
    (peer, sigIdx, ctx, flags, comm, stream))                                                                         \
  X(ncclResult_t, RESULT, ncclWaitSignal,                                                                      \
    (int nDesc, ncclWaitSignalDesc_t *signalDescs, ncclComm_t comm, cudaStream_t stream),                             \
    (nDesc, signalDescs, comm, stream))                                                                               \
  X(ncclResult_t, RESULT, ncclGroupSimulateEnd, (ncclSimInfo_t * simInfo), (simInfo))                          \
  X(ncclResult_t, RESULT, ncclSetEncryption, (const ncclEncryptionConfig_t *config), (config))                 \
  X(ncclResult_t, RESULT, ncclParamBind, (ncclParamHandle_t * out, const char *key), (out, key))               \
  X(ncclResult_t, RESULT, ncclParamGetI8, (ncclParamHandle_t h, int8_t *out), (h, out))                        \
  X(ncclResult_t, RESULT, ncclParamGetI16, (ncclParamHandle_t h, int16_t *out), (h, out))                      \
  X(ncclResult_t, RESULT, ncclParamGetI32, (ncclParamHandle_t h, int32_t *out), (h, out))                      \
  X(ncclResult_t, RESULT, ncclParamGetI64, (ncclParamHandle_t h, int64_t *out), (h, out))                      \
  X(ncclResult_t, RESULT, ncclParamGetU8, (ncclParamHandle_t h, uint8_t *out), (h, out))                       \
  X(ncclResult_t, RESULT, ncclParamGetU16, (ncclParamHandle_t h, uint16_t *out), (h, out))                     \
  X(ncclResult_t, RESULT, ncclParamGetU32, (ncclParamHandle_t h, uint32_t *out), (h, out))                     \
  X(ncclResult_t, RESULT, ncclParamGetU64, (ncclParamHandle_t h, uint64_t *out), (h, out))                     \
  X(ncclResult_t, RESULT, ncclParamGetStr, (ncclParamHandle_t h, const char **out), (h, out))                  \
  X(ncclResult_t, RESULT, ncclParamGet, (ncclParamHandle_t h, void *out, int maxLen, int *len),                \
    (h, out, maxLen, len))                                                                                            \
  X(ncclResult_t, RESULT, ncclParamGetParameter, (const char *key, const char **value, int *valueLen),        \
    (key, value, valueLen))                                                                                           \
  X(ncclResult_t, RESULT, ncclParamGetAllParameterKeys, (const char ***table, int *tableLen), (table, tableLen)) \
  X(ncclResult_t, RESULT, ncclCommQueryProperties, (ncclComm_t comm, ncclCommProperties_t * props),           \
    (comm, props))                                                                                                    \
  X(ncclResult_t, RESULT, ncclDevCommCreate,                                                                   \
    (ncclComm_t comm, const ncclDevCommRequirements_t *reqs, ncclDevComm_t *outDevComm), (comm, reqs, outDevComm))    \
  X(ncclResult_t, RESULT, ncclDevCommDestroy, (ncclComm_t comm, const ncclDevComm_t *devComm), (comm, devComm)) \
  X(ncclResult_t, RESULT, ncclGetLsaMultimemDevicePointer, (ncclWindow_t window, size_t offset, void **outPtr), \
    (window, offset, outPtr))                                                                                         \
  X(ncclResult_t, RESULT, ncclGetMultimemDevicePointer,                                                        \
    (ncclWindow_t window, size_t offset, ncclMultimemHandle_t multimem, void **outPtr), (window, offset, multimem, outPtr)) \
  X(ncclResult_t, RESULT, ncclGetLsaDevicePointer,                                                             \
    (ncclWindow_t window, size_t offset, int lsaRank, void **outPtr), (window, offset, lsaRank, outPtr))              \
  X(ncclResult_t, RESULT, ncclGetPeerDevicePointer,                                                            \
    (ncclWindow_t window, size_t offset, int peer, void **outPtr), (window, offset, peer, outPtr))                    \
  X(ncclResult_t, RESULT, ncclGetMultimemDeviceLeInfo,                                                         \
    (ncclWindow_t window, size_t offset, ncclCftLeId * leId, size_t * leOffset), (window, offset, leId, leOffset))    \
  X(ncclResult_t, RESULT, ncclGetCftDeviceLeInfo,                                                              \
    (ncclWindow_t window, size_t offset, int peerCft, ncclTeam_t cftTeam, ncclCftLeId *leId, size_t *leOffset),       \
    (window, offset, peerCft, cftTeam, leId, leOffset))                                                               \
  X(ncclResult_t, RESULT, ncclGetPeerDeviceLeInfo,                                                             \
    (ncclWindow_t window, size_t offset, int peerWorld, ncclCftLeId *leId, size_t *leOffset),                         \
    (window, offset, peerWorld, leId, leOffset))                                                                      \
  X(ncclTeam_t, TEAM, ncclTeamWorld, (ncclComm_t comm), (comm))                                                  \
  X(ncclTeam_t, TEAM, ncclTeamLsa, (ncclComm_t comm), (comm))                                                    \
  X(ncclTeam_t, TEAM, ncclTeamCft, (ncclComm_t comm, ncclCftTeamMode_t mode), (comm, mode))                      \
  X(ncclTeam_t, TEAM, ncclTeamCftMultimem, (ncclComm_t comm), (comm))                                            \
  X(ncclTeam_t, TEAM, ncclTeamRail, (ncclComm_t comm), (comm))                                                   \
  X(int, INT, ncclTeamRankToWorld, (ncclComm_t comm, ncclTeam_t team, int rank), (comm, team, rank))                  \
  X(int, INT, ncclTeamRankToLsa, (ncclComm_t comm, ncclTeam_t team, int rank), (comm, team, rank))                    \
  X(ncclResult_t, RESULT, ncclLsaBarrierCreateRequirement,                                                     \
    (ncclTeam_t team, int nBarriers, ncclLsaBarrierHandle_t *outHandle, ncclDevResourceRequirements_t *outReq),       \
    (team, nBarriers, outHandle, outReq))                                                                             \
  X(ncclResult_t, RESULT, ncclGinBarrierCreateRequirement,                                                     \
    (ncclComm_t comm, ncclTeam_t team, int nBarriers, ncclGinBarrierHandle_t *outHandle,                              \
     ncclDevResourceRequirements_t *outReq), (comm, team, nBarriers, outHandle, outReq))                              \
  X(int, INT, ncclLLA2ACalcSlots, (int maxElts, int maxEltSize), (maxElts, maxEltSize))                               \
  X(ncclResult_t, RESULT, ncclLLA2ACreateRequirement,                                                          \
    (int nBlocks, int nSlots, ncclLLA2AHandle_t *outHandle, ncclDevResourceRequirements_t *outReq),                   \
    (nBlocks, nSlots, outHandle, outReq))

#define DEFINE_UNMODELLED(type, value, name, params, args)                                                            \
  static type(*real_##name) params;                                                                                   \
  type name params {                                                                                                  \
    if (!simulated && (real_##name || (real_##name = real_symbol(#name)))) return real_##name args;                   \
    int raised_ = unavailable(#name);                                                                                 \
    (void)raised_;                                                                                                    \
    return value;                                                                                                     \
  }
UNMODELLED(DEFINE_UNMODELLED)

static void (*real_ncclParamDumpAll)(void);
void ncclParamDumpAll(void) {
  if (!simulated && (real_ncclParamDumpAll || (real_ncclParamDumpAll = real_symbol("ncclParamDumpAll")))) {
    real_ncclParamDumpAll();
    return;
  }
  unavailable("ncclParamDumpAll");
}

/* --- registration --------------------------------------------------------------------------------------------- */

#define SLOT(name, params, args) {#name, (void **)&sim_##name},
static const struct {
  const char *name;
  void **slot;
} slots[] = {MODELLED(SLOT){"ncclCommInitRankConfig", (void **)&sim_ncclCommInitRankConfig},
             {"unmodelled", (void **)&on_unmodelled},
             {"missing", (void **)&on_missing}};

/* Sets the handler of a modelled function (or of "unmodelled"/"missing" calls); NULL clears it; -1: no such name. */
int simnccl_set(const char *name, void *handler) {
  for (size_t i = 0; i < sizeof(slots) / sizeof(slots[0]); i++) {
    if (strcmp(slots[i].name, name) == 0) {
      *slots[i].slot = handler;
      return 0;
    }
  }
  return -1;
}

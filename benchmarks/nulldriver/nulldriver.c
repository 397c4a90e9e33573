/* A null CUDA driver: a libcuda.so.1 that completes all work at enqueue, for
   measuring the host side of the launch path on a machine without a GPU.

   Build and use (from the repository root):

       bash benchmarks/nulldriver/build.sh            # -> benchmarks/nulldriver/build/libcuda.so.1
       LD_LIBRARY_PATH=benchmarks/nulldriver/build python3 benchmarks/instructions.py typed

   cuda.bindings resolves every driver function through cuGetProcAddress,
   which answers from the table of the functions below (others: not found).
   "Device" memory is host memory, so copies and fills are real; kernels do
   nothing (a launch checks its function and arguments, counts itself and
   busy-waits NULLDRIVER_LAUNCH_NS nanoseconds, 0 by default); streams,
   events and flag writes complete at once (a flag write stores its value).
   The device reports an H200's limits. Timings from it are not a GPU's:
   use it for instruction counts and profiles of the library's own work. */
#define _GNU_SOURCE
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <stdio.h>
#include <time.h>
#define EXPORT __attribute__((visibility("default")))
typedef int CUresult;
typedef unsigned long long u64;
static long long g_launch_ns = -1;
static u64 g_launches;
static int g_log = -1;
static __thread void *t_ctx;
static char g_ctx_obj[64];
static void note(const char *name) {
    if (g_log < 0) g_log = getenv("NULLDRIVER_LOG") != NULL;
    if (g_log) fprintf(stderr, "nulldriver: %s\n", name);
}
#define S(name, ...) EXPORT CUresult name(__VA_ARGS__)
S(cuInit, unsigned f) { return 0; }
S(cuDriverGetVersion, int *v) { *v = 13000; return 0; }
S(cuDeviceGetCount, int *n) { *n = 1; return 0; }
S(cuDeviceGet, int *d, int o) { if (o != 0) return 101; *d = 0; return 0; }
S(cuDeviceGetName, char *s, int len, int d) { snprintf(s, len, "Null driver (H200 limits)"); return 0; }
S(cuDeviceTotalMem, size_t *b, int d) { *b = 140ULL << 30; return 0; }
S(cuDeviceGetUuid, char *u, int d) { memset(u, 7, 16); return 0; }
S(cuDeviceGetAttribute, int *pi, int a, int d) {
    int v = 0;
    switch (a) {
    case 1: v = 1024; break; case 2: v = 1024; break; case 3: v = 1024; break; case 4: v = 64; break;
    case 5: v = 2147483647; break; case 6: case 7: v = 65535; break; case 8: v = 49152; break;
    case 9: v = 65536; break; case 10: v = 32; break; case 12: v = 65536; break; case 13: v = 1980000; break;
    case 16: v = 132; break; case 19: v = 1; break; case 31: v = 1; break; case 33: v = 1; break;
    case 36: v = 2619000; break; case 37: v = 6144; break; case 38: v = 50331648; break;
    case 39: v = 2048; break; case 40: v = 3; break; case 41: v = 1; break; case 75: v = 9; break;
    case 76: v = 0; break; case 81: v = 233472; break; case 83: v = 1; break; case 92: v = 1; break;
    case 95: v = 1; break; case 97: v = 232448; break; case 102: v = 1; break; case 106: v = 32; break;
    case 111: v = 1024; break; /* reserved shared memory per block */
    case 115: v = 1; break; case 120: v = 1; break; case 122: v = 1; break; case 123: v = 1; break;
    default: v = 0;
    }
    *pi = v; return 0;
}
S(cuDeviceCanAccessPeer, int *c, int a, int b) { *c = 0; return 0; }
S(cuDevicePrimaryCtxRetain, void **c, int d) { *c = g_ctx_obj; return 0; }
S(cuDevicePrimaryCtxRelease, int d) { return 0; }
S(cuDevicePrimaryCtxGetState, int d, unsigned *f, int *active) { *f = 0; *active = 1; return 0; }
S(cuCtxSetCurrent, void *c) { t_ctx = c; return 0; }
S(cuCtxGetCurrent, void **c) { *c = t_ctx; return 0; }
S(cuCtxPushCurrent, void *c) { t_ctx = c; return 0; }
S(cuCtxPopCurrent, void **c) { if (c) *c = t_ctx; return 0; }
S(cuCtxGetDevice, int *d) { *d = 0; return 0; }
S(cuCtxSynchronize, void) { return 0; }
S(cuCtxEnablePeerAccess, void *c, unsigned f) { return 0; }
S(cuCtxGetApiVersion, void *c, unsigned *v) { *v = 13000; return 0; }
S(cuCtxGetId, void *c, u64 *id) { *id = 1; return 0; }
S(cuMemGetInfo, size_t *f, size_t *t) { *f = 100ULL << 30; *t = 140ULL << 30; return 0; }
static void *dalloc(size_t n) { void *p = NULL; if (posix_memalign(&p, 256, n ? n : 1)) return NULL; memset(p, 0, n); return p; }
S(cuMemAlloc, u64 *p, size_t n) { void *q = dalloc(n); if (!q) return 2; *p = (u64)(uintptr_t)q; return 0; }
S(cuMemAllocAsync, u64 *p, size_t n, void *s) { return cuMemAlloc(p, n); }
S(cuMemAllocFromPoolAsync, u64 *p, size_t n, void *pool, void *s) { return cuMemAlloc(p, n); }
S(cuMemFree, u64 p) { free((void *)(uintptr_t)p); return 0; }
S(cuMemFreeAsync, u64 p, void *s) { return cuMemFree(p); }
S(cuMemHostAlloc, void **p, size_t n, unsigned f) { *p = dalloc(n); return *p ? 0 : 2; }
S(cuMemAllocHost, void **p, size_t n) { *p = dalloc(n); return *p ? 0 : 2; }
S(cuMemFreeHost, void *p) { free(p); return 0; }
S(cuMemHostGetDevicePointer, u64 *d, void *p, unsigned f) { *d = (u64)(uintptr_t)p; return 0; }
S(cuMemHostRegister, void *p, size_t n, unsigned f) { return 0; }
S(cuMemHostUnregister, void *p) { return 0; }
S(cuMemcpyHtoD, u64 d, const void *s, size_t n) { memcpy((void *)(uintptr_t)d, s, n); return 0; }
S(cuMemcpyDtoH, void *d, u64 s, size_t n) { memcpy(d, (void *)(uintptr_t)s, n); return 0; }
S(cuMemcpyDtoD, u64 d, u64 s, size_t n) { memmove((void *)(uintptr_t)d, (void *)(uintptr_t)s, n); return 0; }
S(cuMemcpyHtoDAsync, u64 d, const void *s, size_t n, void *st) { return cuMemcpyHtoD(d, s, n); }
S(cuMemcpyDtoHAsync, void *d, u64 s, size_t n, void *st) { return cuMemcpyDtoH(d, s, n); }
S(cuMemcpyDtoDAsync, u64 d, u64 s, size_t n, void *st) { return cuMemcpyDtoD(d, s, n); }
S(cuMemcpyAsync, u64 d, u64 s, size_t n, void *st) { return cuMemcpyDtoD(d, s, n); }
S(cuMemcpy, u64 d, u64 s, size_t n) { return cuMemcpyDtoD(d, s, n); }
S(cuMemcpyPeerAsync, u64 d, void *dc, u64 s, void *sc, size_t n, void *st) { return cuMemcpyDtoD(d, s, n); }
S(cuMemsetD8, u64 d, unsigned char v, size_t n) { memset((void *)(uintptr_t)d, v, n); return 0; }
S(cuMemsetD8Async, u64 d, unsigned char v, size_t n, void *s) { return cuMemsetD8(d, v, n); }
S(cuMemsetD16Async, u64 d, unsigned short v, size_t n, void *s) { unsigned short *p = (void *)(uintptr_t)d; for (size_t i = 0; i < n; i++) p[i] = v; return 0; }
S(cuMemsetD32Async, u64 d, unsigned v, size_t n, void *s) { unsigned *p = (void *)(uintptr_t)d; for (size_t i = 0; i < n; i++) p[i] = v; return 0; }
S(cuMemsetD32, u64 d, unsigned v, size_t n) { return cuMemsetD32Async(d, v, n, NULL); }
S(cuMemsetD2D32Async, u64 d, size_t pitch, unsigned v, size_t w, size_t h, void *s) {
    for (size_t r = 0; r < h; r++) cuMemsetD32Async(d + r * pitch, v, w, s); return 0; }
static char g_pool[64];
S(cuDeviceGetDefaultMemPool, void **p, int d) { *p = g_pool; return 0; }
S(cuDeviceGetMemPool, void **p, int d) { *p = g_pool; return 0; }
S(cuMemPoolSetAccess, void *p, const void *m, size_t n) { return 0; }
S(cuMemPoolSetAttribute, void *p, int a, void *v) { return 0; }
S(cuMemPoolGetAttribute, void *p, int a, void *v) { memset(v, 0, 8); return 0; }
S(cuMemPoolTrimTo, void *p, size_t n) { return 0; }
S(cuPointerGetAttribute, void *data, int a, u64 p) {
    switch (a) {
    case 1: *(void **)data = g_ctx_obj; break;      /* context */
    case 2: *(unsigned *)data = 2; break;           /* memory type: device */
    case 3: *(u64 *)data = p; break;                /* device pointer */
    case 4: *(void **)data = (void *)(uintptr_t)p; break;
    case 9: *(int *)data = 0; break;                /* device ordinal */
    default: memset(data, 0, 8);
    }
    return 0;
}
S(cuPointerGetAttributes, unsigned n, int *a, void **d, u64 p) { for (unsigned i = 0; i < n; i++) cuPointerGetAttribute(d[i], a[i], p); return 0; }
/* modules and functions */
typedef struct { char name[256]; int magic; } Fn;
typedef struct { int magic; int nfn; Fn *fns[64]; char names[64][256]; } Mod;
static void collect_entries(Mod *m, const char *img) {
    /* PTX text: ".entry NAME(" ; cubins: nothing */
    if (strncmp(img, "//", 2) != 0 && strstr(img, ".version") == NULL) return;
    const char *p = img;
    while ((p = strstr(p, ".entry")) != NULL && m->nfn < 64) {
        p += 6; while (*p == ' ' || *p == '\t') p++;
        int i = 0; while (p[i] && p[i] != '(' && p[i] != ' ' && p[i] != '\n' && i < 255) { m->names[m->nfn][i] = p[i]; i++; }
        m->names[m->nfn][i] = 0; m->nfn++;
    }
}
S(cuModuleLoadData, void **mod, const void *img) {
    Mod *m = calloc(1, sizeof(Mod)); m->magic = 0x4d4f44; collect_entries(m, img); *mod = m; return 0; }
S(cuModuleLoadDataEx, void **mod, const void *img, unsigned n, void *o, void **ov) { return cuModuleLoadData(mod, img); }
S(cuModuleUnload, void *mod) { return 0; }
S(cuModuleGetFunction, void **f, void *mod, const char *name) {
    Fn *fn = calloc(1, sizeof(Fn)); snprintf(fn->name, sizeof fn->name, "%s", name); fn->magic = 0x464e; *f = fn; return 0; }
S(cuModuleGetFunctionCount, unsigned *n, void *mod) { *n = ((Mod *)mod)->nfn; return 0; }
S(cuModuleEnumerateFunctions, void **fns, unsigned n, void *mod) {
    Mod *m = mod; for (unsigned i = 0; i < n && (int)i < m->nfn; i++) cuModuleGetFunction(&fns[i], mod, m->names[i]); return 0; }
S(cuFuncGetName, const char **name, void *f) { *name = ((Fn *)f)->name; return 0; }
S(cuFuncGetAttribute, int *v, int a, void *f) {
    switch (a) { case 0: *v = 1024; break; case 4: *v = 16; break; case 5: *v = 90; break; case 6: *v = 90; break; default: *v = 0; }
    return 0; }
S(cuFuncSetAttribute, void *f, int a, int v) { return 0; }
S(cuFuncSetCacheConfig, void *f, int c) { return 0; }
S(cuFuncGetParamInfo, void *f, size_t i, size_t *off, size_t *size) { return 801; }
S(cuOccupancyMaxActiveBlocksPerMultiprocessor, int *n, void *f, int b, size_t s) { *n = 16; return 0; }
S(cuOccupancyMaxActiveClusters, int *n, void *f, const void *cfg) { *n = 32; return 0; }
/* streams, events */
S(cuStreamCreate, void **s, unsigned f) { *s = calloc(1, 64); return 0; }
S(cuStreamCreateWithPriority, void **s, unsigned f, int p) { return cuStreamCreate(s, f); }
S(cuStreamDestroy, void *s) { free(s); return 0; }
S(cuStreamQuery, void *s) { return 0; }
S(cuStreamSynchronize, void *s) { return 0; }
S(cuStreamWaitEvent, void *s, void *e, unsigned f) { return 0; }
S(cuStreamGetCtx, void *s, void **c) { *c = g_ctx_obj; return 0; }
S(cuStreamGetId, void *s, u64 *id) { *id = (u64)(uintptr_t)s; return 0; }
S(cuStreamGetFlags, void *s, unsigned *f) { *f = 1; return 0; }
S(cuStreamWriteValue32, void *s, u64 a, unsigned v, unsigned f) { *(volatile unsigned *)(uintptr_t)a = v; return 0; }
S(cuStreamWriteValue64, void *s, u64 a, u64 v, unsigned f) { *(volatile u64 *)(uintptr_t)a = v; return 0; }
S(cuStreamWaitValue32, void *s, u64 a, unsigned v, unsigned f) { return 0; }
S(cuStreamWaitValue64, void *s, u64 a, u64 v, unsigned f) { return 0; }
S(cuLaunchHostFunc, void *s, void (*fn)(void *), void *d) { fn(d); return 0; }
static int g_capturing;
S(cuStreamBeginCapture, void *s, int mode) { g_capturing = 1; return 0; }
S(cuStreamEndCapture, void *s, void **g) { g_capturing = 0; *g = calloc(1, 64); return 0; }
S(cuStreamIsCapturing, void *s, int *st) { *st = g_capturing; return 0; }
S(cuThreadExchangeStreamCaptureMode, int *m) { return 0; }
S(cuGraphInstantiate, void **e, void *g, u64 f) { *e = calloc(1, 64); return 0; }
S(cuGraphInstantiateWithFlags, void **e, void *g, u64 f) { *e = calloc(1, 64); return 0; }
S(cuGraphLaunch, void *e, void *s) { return 0; }
S(cuGraphUpload, void *e, void *s) { return 0; }
S(cuGraphDestroy, void *g) { free(g); return 0; }
S(cuGraphExecDestroy, void *e) { free(e); return 0; }
S(cuGraphExecUpdate, void *e, void *g, void *info) { if (info) memset(info, 0, 16); return 0; }
S(cuEventCreate, void **e, unsigned f) { *e = calloc(1, 16); return 0; }
S(cuEventDestroy, void *e) { free(e); return 0; }
S(cuEventRecord, void *e, void *s) { return 0; }
S(cuEventRecordWithFlags, void *e, void *s, unsigned f) { return 0; }
S(cuEventQuery, void *e) { return 0; }
S(cuEventSynchronize, void *e) { return 0; }
S(cuEventElapsedTime, float *ms, void *a, void *b) { *ms = 0.001f; return 0; }
static void spin(void) {
    if (g_launch_ns < 0) { const char *e = getenv("NULLDRIVER_LAUNCH_NS"); g_launch_ns = e ? atoll(e) : 0; }
    if (g_launch_ns <= 0) return;
    struct timespec t0, t; clock_gettime(CLOCK_MONOTONIC, &t0);
    do clock_gettime(CLOCK_MONOTONIC, &t);
    while ((t.tv_sec - t0.tv_sec) * 1000000000LL + (t.tv_nsec - t0.tv_nsec) < g_launch_ns);
}
S(cuLaunchKernel, void *f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by, unsigned bz,
  unsigned smem, void *s, void **params, void **extra) {
    if (f == NULL || ((Fn *)f)->magic != 0x464e) return 400;
    if (params == NULL && extra == NULL) return 1;
    spin(); g_launches++; return 0;
}
typedef struct { unsigned gx, gy, gz, bx, by, bz, smem; void *s; void *attrs; unsigned n; } LaunchConfig;
S(cuLaunchKernelEx, const LaunchConfig *c, void *f, void **params, void **extra) {
    return cuLaunchKernel(f, c->gx, c->gy, c->gz, c->bx, c->by, c->bz, c->smem, c->s, params, extra); }
S(cuLaunchCooperativeKernel, void *f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by, unsigned bz,
  unsigned smem, void *s, void **params) { return cuLaunchKernel(f, gx, gy, gz, bx, by, bz, smem, s, params, NULL); }
EXPORT u64 nulldriver_launches(void) { return g_launches; }
S(cuGetErrorName, int e, const char **s) {
    switch (e) { case 0: *s = "CUDA_SUCCESS"; break; case 1: *s = "CUDA_ERROR_INVALID_VALUE"; break;
    case 2: *s = "CUDA_ERROR_OUT_OF_MEMORY"; break; case 400: *s = "CUDA_ERROR_INVALID_HANDLE"; break;
    case 500: *s = "CUDA_ERROR_NOT_FOUND"; break; case 801: *s = "CUDA_ERROR_NOT_SUPPORTED"; break;
    default: *s = "CUDA_ERROR_UNKNOWN"; }
    return 0; }
S(cuGetErrorString, int e, const char **s) { return cuGetErrorName(e, s); }
static CUresult unsupported(void) { return 801; }
#include "build/table.h"
S(cuGetProcAddress_v2, const char *sym, void **pfn, int ver, u64 flags, int *status);
S(cuGetProcAddress_v2, const char *sym, void **pfn, int ver, u64 flags, int *status) {
    if (strcmp(sym, "cuGetProcAddress") == 0) { *pfn = (void *)cuGetProcAddress_v2; if (status) *status = 0; return 0; }
    for (size_t i = 0; i < sizeof(TABLE) / sizeof(TABLE[0]); i++)
        if (strcmp(TABLE[i].name, sym) == 0) { *pfn = TABLE[i].fn; if (status) *status = 0; return 0; }
    note(sym);
    *pfn = NULL; if (status) *status = 1; return 500;
}
S(cuGetProcAddress, const char *sym, void **pfn, int ver, u64 flags) { return cuGetProcAddress_v2(sym, pfn, ver, flags, NULL); }
S(cuGetExportTable, const void **t, const void *id) { return 500; }

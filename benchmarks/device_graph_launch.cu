// Probe for benchmarks/device_graph_launch.py: can a fused call's replay graph (copies to and from pinned
// host memory on one branch, kernels waiting for them on the other) be launched from the device, so
// that the host pays one small launch whatever the number of nodes?  One case per run; prints one JSON line.
#include <cuda.h>
#include <cuda_runtime.h>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <vector>
#include <algorithm>

#define CK(x) do { cudaError_t e_ = (x); if (e_ != cudaSuccess) { printf("{\"error\": \"%s at %s:%d\"}\n", cudaGetErrorString(e_), #x, __LINE__); fflush(stdout); return 1; } } while (0)
#define CKR(x) do { cudaError_t e_ = (x); if (e_ != cudaSuccess) { printf("{\"case\":\"%s\",\"error\": \"%s at %s\"}\n", label, cudaGetErrorString(e_), #x); fflush(stdout); return -1; } } while (0)

__global__ void fill(int* p, size_t n, int seed) { for (size_t i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) p[i] = (int)(i * 2654435761u) ^ seed; }
__global__ void consume(const int* src, int* dst, size_t n) { for (size_t i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) dst[i] = src[i] + 1; }
__global__ void nap(long ns) { long t = 0; while (t < ns) { __nanosleep(100000); t += 100000; } }
__global__ void count_bad(const int* a, const int* b, size_t n, unsigned long long* bad) { for (size_t i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) if (b[i] != a[i] + 1) atomicAdd(bad, 1ull); }
__global__ void launch_tail(cudaGraphExec_t g) { if (cudaGraphLaunch(g, cudaStreamGraphTailLaunch) != cudaSuccess) asm("trap;"); }
__global__ void launch_ff(cudaGraphExec_t g) { if (cudaGraphLaunch(g, cudaStreamGraphFireAndForget) != cudaSuccess) asm("trap;"); }

struct Buf { int *src, *mid, *out; int* host; unsigned* flag; size_t n; };

// the call: per piece, D2H then H2D on the side branch, then the consumer on the main branch
static int capture(cudaStream_t s, cudaStream_t s2, const Buf& b, int pieces, bool with_nap, bool with_wait_value,
                   cudaGraph_t* g, const char* label) {
  std::vector<cudaEvent_t> ev(pieces + 1);
  for (auto& e : ev) CKR(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
  size_t per = b.n / pieces;
  CKR(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
  CKR(cudaEventRecord(ev[pieces], s));
  CKR(cudaStreamWaitEvent(s2, ev[pieces], 0));
  if (with_nap) nap<<<1, 1, 0, s2>>>(20000000);  // 20 ms: a late peer
  if (with_wait_value) {
    CUresult r = cuStreamWaitValue32((CUstream)s2, (CUdeviceptr)b.flag, 0, CU_STREAM_WAIT_VALUE_GEQ);
    if (r != CUDA_SUCCESS) { printf("{\"case\":\"%s\",\"error\":\"cuStreamWaitValue32 %d\"}\n", label, (int)r); }
  }
  for (int i = 0; i < pieces; i++) {
    CKR(cudaMemcpyAsync(b.host + i * per, b.src + i * per, per * 4, cudaMemcpyDeviceToHost, s2));
    CKR(cudaMemcpyAsync(b.mid + i * per, b.host + i * per, per * 4, cudaMemcpyHostToDevice, s2));
    CKR(cudaEventRecord(ev[i], s2));
    CKR(cudaStreamWaitEvent(s, ev[i], 0));
    consume<<<64, 256, 0, s>>>(b.mid + i * per, b.out + i * per, per);
  }
  CKR(cudaStreamEndCapture(s, g));
  return 0;
}

static double median(std::vector<double> v) { std::sort(v.begin(), v.end()); return v[v.size() / 2]; }

static int run_case(const char* label, int pieces, const char* mode, bool with_wait_value) {
  cudaStream_t s, s2;
  CKR(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  CKR(cudaStreamCreateWithFlags(&s2, cudaStreamNonBlocking));
  Buf b; b.n = (size_t)pieces * 16384;
  CKR(cudaMalloc(&b.src, b.n * 4)); CKR(cudaMalloc(&b.mid, b.n * 4)); CKR(cudaMalloc(&b.out, b.n * 4));
  CKR(cudaHostAlloc(&b.host, b.n * 4, cudaHostAllocMapped)); CKR(cudaMalloc(&b.flag, 4)); CKR(cudaMemset(b.flag, 0, 4));
  unsigned long long* bad; CKR(cudaMalloc(&bad, 8)); CKR(cudaMemset(bad, 0, 8));
  bool device = mode[0] != 'h';
  bool tail = mode[0] == 't';
  // work graph and (for device modes) its napping twin, for the ordering check
  cudaGraph_t g, gn; cudaGraphExec_t x, xn;
  if (capture(s, s2, b, pieces, false, with_wait_value, &g, label)) return -1;
  if (capture(s, s2, b, pieces, true, with_wait_value, &gn, label)) return -1;
  size_t nodes = 0; CKR(cudaGraphGetNodes(g, nullptr, &nodes));
  unsigned long long flags = device ? cudaGraphInstantiateFlagDeviceLaunch : 0;
  CKR(cudaGraphInstantiateWithFlags(&x, g, flags));
  CKR(cudaGraphInstantiateWithFlags(&xn, gn, flags));
  if (device) { CKR(cudaGraphUpload(x, s)); CKR(cudaGraphUpload(xn, s)); }
  // what the host launches: the work graph itself, or a one-kernel graph that launches it
  cudaGraphExec_t host_x = x, host_xn = xn;
  if (device) {
    cudaGraph_t lg, lgn;
    CKR(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
    if (tail) launch_tail<<<1, 1, 0, s>>>(x); else launch_ff<<<1, 1, 0, s>>>(x);
    CKR(cudaStreamEndCapture(s, &lg));
    CKR(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
    if (tail) launch_tail<<<1, 1, 0, s>>>(xn); else launch_ff<<<1, 1, 0, s>>>(xn);
    CKR(cudaStreamEndCapture(s, &lgn));
    CKR(cudaGraphInstantiate(&host_x, lg, 0)); CKR(cudaGraphInstantiate(&host_xn, lgn, 0));
    CKR(cudaGraphUpload(host_x, s)); CKR(cudaGraphUpload(host_xn, s));
  }
  // correctness and ordering: new values, the (napping) call, then a check on the same stream
  unsigned long long bad_total = 0;
  for (int it = 0; it < 6; it++) {
    fill<<<64, 256, 0, s>>>(b.src, b.n, it * 7919);
    CKR(cudaGraphLaunch(it % 2 ? host_xn : host_x, s));
    count_bad<<<64, 256, 0, s>>>(b.src, b.out, b.n, bad);
    CKR(cudaStreamSynchronize(s));
  }
  CKR(cudaMemcpy(&bad_total, bad, 8, cudaMemcpyDeviceToHost));
  // host time of one launch, the device idle before each (median of 200)
  std::vector<double> us;
  for (int it = 0; it < 200; it++) {
    CKR(cudaStreamSynchronize(s));
    auto t0 = std::chrono::steady_clock::now();
    CKR(cudaGraphLaunch(host_x, s));
    auto t1 = std::chrono::steady_clock::now();
    us.push_back(std::chrono::duration<double, std::micro>(t1 - t0).count());
  }
  CKR(cudaStreamSynchronize(s));
  // device time of one call (events around 50 back-to-back launches)
  cudaEvent_t e0, e1; CKR(cudaEventCreate(&e0)); CKR(cudaEventCreate(&e1));
  CKR(cudaEventRecord(e0, s)); for (int it = 0; it < 50; it++) CKR(cudaGraphLaunch(host_x, s)); CKR(cudaEventRecord(e1, s));
  CKR(cudaEventSynchronize(e1)); float ms = 0; CKR(cudaEventElapsedTime(&ms, e0, e1));
  printf("{\"case\":\"%s\",\"mode\":\"%s\",\"pieces\":%d,\"wait_value\":%d,\"work_graph_nodes\":%zu,\"host_launch_us_median\":%.2f,"
         "\"host_launch_us_p10\":%.2f,\"device_us_per_call\":%.1f,\"mismatches\":%llu}\n",
         label, mode, pieces, (int)with_wait_value, nodes, median(us), [&]{ auto v = us; std::sort(v.begin(), v.end()); return v[v.size()/10]; }(),
         ms * 1000 / 50, bad_total);
  fflush(stdout);
  return 0;
}

int main(int argc, char** argv) {
  if (argc != 4) { printf("usage: devlaunch host|tail|fireforget PIECES WAIT_VALUE(0|1)\n"); return 2; }
  CK(cudaSetDevice(0)); CK(cudaFree(0));
  char label[64]; snprintf(label, sizeof label, "%s-p%s-wv%s", argv[1], argv[2], argv[3]);
  return run_case(label, atoi(argv[2]), argv[1], atoi(argv[3])) ? 1 : 0;
}

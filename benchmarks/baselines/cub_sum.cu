// CUB baseline for fusekit's reduce_sum: cub::DeviceReduce::Sum over a contiguous float32 tensor.
//
// Floor: n * 4 bytes read once, 4 bytes written; 0 matrix FLOPs. On the H200 this ran at ~4530 GB/s
// for 2^30 elements, above the 4283 GB/s a device-to-device copy reaches (a reduction only reads).
//
// Built into a torch extension by python/fusekit/bench/cub.py (torch.utils.cpp_extension.load with
// nvcc, cached in a temp dir, no network). `-DCUB_SUM_STANDALONE` compiles only the CUB part, so the
// file can be syntax-checked with nvcc on a machine whose torch has no CUDA headers.
#include <cstdint>
#include <cub/device/device_reduce.cuh>

// Two-phase CUB call: with temp == nullptr it only sets temp_bytes.
cudaError_t fusekit_cub_sum(const float* x, float* out, int64_t n, void* temp, size_t& temp_bytes,
                                   cudaStream_t stream) {
  return cub::DeviceReduce::Sum(temp, temp_bytes, x, out, n, stream);
}

#ifndef CUB_SUM_STANDALONE
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/extension.h>

// x: contiguous float32 CUDA tensor of any shape -> float32 tensor [1] holding sum(x).
torch::Tensor cub_sum(torch::Tensor x) {
  TORCH_CHECK(x.is_cuda(), "cub_sum: x must be a CUDA tensor");
  TORCH_CHECK(x.scalar_type() == torch::kFloat32, "cub_sum: x must be float32");
  TORCH_CHECK(x.is_contiguous(), "cub_sum: x must be contiguous");
  const c10::cuda::CUDAGuard guard(x.device());
  cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  auto out = torch::empty({1}, x.options());
  size_t temp_bytes = 0;
  C10_CUDA_CHECK(fusekit_cub_sum(x.data_ptr<float>(), out.data_ptr<float>(), x.numel(), nullptr, temp_bytes,
                                 stream));
  // The caching allocator makes this temp buffer free after the first call.
  auto temp = torch::empty({static_cast<int64_t>(temp_bytes)}, x.options().dtype(torch::kUInt8));
  C10_CUDA_CHECK(fusekit_cub_sum(x.data_ptr<float>(), out.data_ptr<float>(), x.numel(), temp.data_ptr(),
                                 temp_bytes, stream));
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("cub_sum", &cub_sum, "CUB DeviceReduce::Sum of a float32 tensor"); }
#endif

// The activations' int8 quantization as tensors: per 32 values for the legacy types, per
// 256 (with sums per 16) for the K-quants. The kernels quantize internally; these entry
// points let the tests check the codes against a float64 emulation. Part of
// quant_matmul.cpp's translation unit (inside its anonymous namespace).

std::vector<at::Tensor> quantize_activations(const at::Tensor& x_in) {
  const at::Tensor x = x_in.contiguous();
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.size(1) % QK == 0,
              "x must be float32 [M, K] with K a multiple of 32");
  const int64_t M = x.size(0), K = x.size(1), nb = K / QK;
  const QuantX r = quantize_rows(x.data_ptr<float>(), M, K);
  const auto f32 = x.options();
  auto copy = [](const void* src, at::Tensor t) {
    std::memcpy(t.data_ptr(), src, t.nbytes());
    return t;
  };
  return {copy(r.q, at::empty({M, K}, f32.dtype(at::kChar))), copy(r.d, at::empty({M, nb}, f32)),
          copy(r.s, at::empty({M, nb}, f32)), copy(r.c, at::empty({M, nb}, f32)),
          copy(r.qsum, at::empty({M, nb}, f32.dtype(at::kInt))),
          copy(r.qlo, at::empty({M, nb}, f32.dtype(at::kInt)))};
}

std::vector<at::Tensor> quantize_activations_k(const at::Tensor& x_in) {
  const at::Tensor x = x_in.contiguous();
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.size(1) % 256 == 0,
              "x must be float32 [M, K] with K a multiple of 256");
  const int64_t M = x.size(0), K = x.size(1);
  const QuantK r = quantize_rows_k(x.data_ptr<float>(), M, K);
  const auto f32 = x.options();
  at::Tensor q = at::empty({M, K}, f32.dtype(at::kChar)), d = at::empty({M, K / 256}, f32);
  at::Tensor bsum = at::empty({M, K / 16}, f32.dtype(at::kInt));
  std::memcpy(q.data_ptr(), r.q, q.nbytes());
  std::memcpy(d.data_ptr(), r.d, d.nbytes());
  std::memcpy(bsum.data_ptr(), r.bsum, bsum.nbytes());
  return {q, d, bsum};
}

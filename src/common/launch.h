// Kernel launches through one macro, so that tests/cpp/emulation can compile a CUDA backend file as plain
// C++ (threads and barriers on the CPU) and check its kernels' logic where no GPU exists. On nvcc it is
// exactly kernel<<<grid, block, 0, stream>>>(args...).
#pragma once

#if defined(GRAPHSAFE_CUDA_EMULATION)
#define GS_LAUNCH(kernel, grid, block, stream, ...) emu_launch((grid), (block), [&] { kernel(__VA_ARGS__); })
#else
#define GS_LAUNCH(kernel, grid, block, stream, ...) kernel<<<(grid), (block), 0, (stream)>>>(__VA_ARGS__)
#endif

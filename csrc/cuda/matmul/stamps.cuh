// Experiment switches of the Hopper GEMM (wgmma_sm90.cu), off by default and set only through
// FASTKERN_NVCC_FLAGS (D-133). Off, this header adds nothing: the kernels' SASS is main's.
//
// -DFK_MM_TIMESTAMPS=1: the first tile of each CTA (blockIdx.x < kStampCtas) records when it reaches
//   each StampEvent, as (%globaltimer ns, clock64 cycles), into stamps[slot][cta][event], a device
//   array; `slot` is the launch's number mod kStampSlots, counted on the host since the last
//   fk_mm_stamps_reset(). tools/mm_stamps.py reads them (through ctypes: fk_mm_stamps_reset /
//   fk_mm_stamps_read, exported by such a build only) and prints per-phase medians. Each unit that
//   includes this header keeps its own stamps; the persistent instances' (wgmma_sm90.cu) are the ones
//   exported, the small problems' (wgmma_sm90_small.cu) with -DFK_MM_STAMP_SMALL=1 (tools/mm_variant.py
//   recompiles one unit: name that one).
//   globaltimer orders CTAs and kernels against each other (its resolution is the card's: read off
//   the stamps); clock64 times the phases inside one CTA (one SM's counter).
// -DFK_MM_LEAN_PROLOGUE=1: what the producer does before its first TMA and needs only kernel
//   parameters (setmaxnreg, the tile counts, the first tile's coordinates: a 64-bit division) moves
//   ahead of griddepcontrol.wait, where programmatic dependent launch hides it under the previous
//   kernel; each role waits for the previous grid itself, right before its first global access.
//   The split-K instances (small problems, D-136) take it whatever the switch says.
#pragma once

#include "matmul.cuh"

#ifndef FK_MM_TIMESTAMPS
#define FK_MM_TIMESTAMPS 0
#endif
#ifndef FK_MM_LEAN_PROLOGUE
#define FK_MM_LEAN_PROLOGUE 0
#endif

namespace fk::mm {

// A CTA's first tile, in order. Thread 0 (the producer) stamps kEntry..kIssued, the first thread of
// consumer 0 (split K: of the consumer that finishes the tile, the cluster rank's) kReady..kEnd, the
// other consumer's kEnd1 (split K: its partial sent).
enum StampEvent {
    kStampEntry,     // kernel entry
    kStampInit,      // mbarriers initialized and fenced, operand maps prefetched
    kStampSynced,    // after __syncthreads
    kStampWaited,    // griddepcontrol.wait returned: the previous grid is done (producer)
    kStampIssued,    // the first stage's TMA loads issued
    kStampReady,     // consumer 0 past setmaxnreg (and, lean, its own wait), before its first full wait
    kStampFull0,     // the first stage has landed (full[0] completed)
    kStampFullLast,  // the last k-step's stage has landed
    kStampMmaDone,   // the last wgmma group retired: the epilogue starts
    kStampStored,    // the epilogue wrote the staging and issued C's TMA store (or stored C)
    kStampEnd,       // consumer 0's bulk stores complete: it exits
    kStampEnd1,      // consumer 1's
    kStampEvents
};
constexpr int kStampSlots = 64, kStampCtas = 160;

#if FK_MM_TIMESTAMPS
namespace {  // each unit's own (wgmma_sm90.cu, wgmma_sm90_small.cu); one unit exports its stamps, below
// The kernel's parameters with the launch's stamp slot.
struct KernelParams : Params {
    int stamp_slot;
};
struct Stamp {
    unsigned long long ns, cycles;
};
__device__ Stamp stamps[kStampSlots][kStampCtas][kStampEvents];  // no -rdc: one array a unit
int stamp_launches = 0;  // launches since fk_mm_stamps_reset (host)

__device__ __forceinline__ void stamp(const KernelParams &p, int event) {
    if (blockIdx.x >= kStampCtas) return;
    unsigned long long ns;
    asm volatile("mov.u64 %0, %%globaltimer;\n" : "=l"(ns)::"memory");  // instrumentation only: not in hopper.cuh
    const unsigned long long cycles = clock64();
    stamps[p.stamp_slot][blockIdx.x][event] = {ns, cycles};
}
#define FK_MM_STAMP(p, event) ::fk::mm::stamp(p, event)

// The parameters a launch passes: p with the next stamp slot.
inline KernelParams stamped(const Params &p) {
    KernelParams q;
    static_cast<Params &>(q) = p;
    q.stamp_slot = stamp_launches++ % kStampSlots;
    return q;
}
}  // namespace
#else
using KernelParams = Params;
#define FK_MM_STAMP(p, event) ((void)0)
inline Params stamped(const Params &p) { return p; }
#endif

}  // namespace fk::mm

#if FK_MM_TIMESTAMPS && FK_MM_STAMPS_EXPORT
// For tools/mm_stamps.py (ctypes; a timestamp build exports them, others do not; the unit defining
// FK_MM_STAMPS_EXPORT: wgmma_sm90.cu, or wgmma_sm90_small.cu with -DFK_MM_STAMP_SMALL=1): zero the stamps
// and the launch count; copy the first `bytes` of the stamps (row-major [slot][cta][event][ns,
// cycles], 8-byte values) to host memory `dst`, after the device's work so far. cudaError_t codes.
extern "C" int fk_mm_stamps_reset(void) {
    fk::mm::stamp_launches = 0;
    void *at = nullptr;
    cudaError_t e = cudaGetSymbolAddress(&at, fk::mm::stamps);
    if (e == cudaSuccess) e = cudaMemset(at, 0, sizeof(fk::mm::stamps));
    return e == cudaSuccess ? (int)cudaDeviceSynchronize() : (int)e;
}
extern "C" int fk_mm_stamps_read(void *dst, size_t bytes) {
    if (bytes > sizeof(fk::mm::stamps)) bytes = sizeof(fk::mm::stamps);
    return (int)cudaMemcpyFromSymbol(dst, fk::mm::stamps, bytes);
}
extern "C" int fk_mm_stamps_shape(int *dims) {  // slots, CTAs, events
    dims[0] = fk::mm::kStampSlots, dims[1] = fk::mm::kStampCtas, dims[2] = fk::mm::kStampEvents;
    return 0;
}
#endif

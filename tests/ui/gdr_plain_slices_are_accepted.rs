//@ check-pass
//@ needs-feature: gdr
// Control for the gdr_* cases: slices of plain-bytes types are device memory.
use std::sync::Arc;

use rdma_verbs::gdr::{self, GdrMode, GpuBuffer};
use rdma_verbs::gdr::cudarc::driver::CudaSlice;
use rdma_verbs::mr::AccessFlags;
use rdma_verbs::pd::Pd;

fn f(
    pd: &Pd,
    a: CudaSlice<u8>,
    b: &mut CudaSlice<f32>,
    c: Arc<CudaSlice<[i64; 4]>>,
    d: CudaSlice<u128>,
) {
    let access = AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE;
    let _ = gdr::register(pd, a, access, GdrMode::Auto);
    let _ = gdr::copy_to_device(b, 0, &[2u8; 16]);
    let _ = gdr::register(pd, c, access, GdrMode::Auto);
    let _ = GpuBuffer::new(pd, d, GdrMode::Auto);
}
fn main() {}

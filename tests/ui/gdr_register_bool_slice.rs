//~ ERROR E0277 PlainBytes
//@ needs-feature: gdr
// A peer's WRITE must not produce invalid `bool`s: register refuses CudaSlice<bool>.
use std::sync::Arc;

use rdma_verbs::gdr::{self, GdrMode};
use rdma_verbs::gdr::cudarc::driver::CudaSlice;
use rdma_verbs::mr::AccessFlags;
use rdma_verbs::pd::Pd;

fn f(pd: &Pd, slice: CudaSlice<bool>) {
    let access = AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE;
    let _ = gdr::register(pd, Arc::new(slice), access, GdrMode::Auto);
}
fn main() {}

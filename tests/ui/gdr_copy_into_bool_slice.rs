//~ ERROR E0277 PlainBytes
//@ needs-feature: gdr
// Arbitrary bytes must not become `bool`s: copy_to_device refuses CudaSlice<bool>.
use rdma_verbs::gdr::{self};
use rdma_verbs::gdr::cudarc::driver::CudaSlice;

fn f(slice: &mut CudaSlice<bool>) {
    let _ = gdr::copy_to_device(slice, 0, &[2u8; 16]);
}
fn main() {}

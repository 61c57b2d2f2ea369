use rdma_verbs::qp::Rts;
use rdma_verbs::{Qp, Rc, RemoteMr, SendWr, SharedMr};
#[inline(never)]
pub fn one(qp: &mut Qp<Rc, Rts>, src: &SharedMr, remote: RemoteMr, k: u64, sig: bool) -> bool {
    qp.post_send(SendWr::write(k, remote, 0).sge(src.clone()).signaled(sig))
        .is_ok()
}
#[inline(never)]
pub fn two(qp: &mut Qp<Rc, Rts>, src: &SharedMr, remote: RemoteMr, k: u64) -> bool {
    qp.post_send(SendWr::write(k, remote, 0).sge(src.clone()))
        .is_ok()
}
fn main() {
    let f: fn(&mut Qp<Rc, Rts>, &SharedMr, RemoteMr, u64, bool) -> bool = one;
    let g: fn(&mut Qp<Rc, Rts>, &SharedMr, RemoteMr, u64) -> bool = two;
    println!("{:p} {:p}", f as *const (), g as *const ());
}

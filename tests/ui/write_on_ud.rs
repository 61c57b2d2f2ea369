//~ ERROR E0599 no function or associated item named `write_from` found
#![allow(unused_imports, unused_variables, unused_mut)]
use rdma_verbs::qp::Rts;
use rdma_verbs::{AddressHandle, Mr, Qp, RemoteMr, Ud, UdSendWr};

fn f(qp: &mut Qp<Ud, Rts>, src: Mr, remote: RemoteMr, ah: &AddressHandle) {
    let _ = qp.post_send(UdSendWr::write_from(1, src, remote, 0)); // UD has no RDMA
}
fn main() {}

//~ ERROR E0599 no function or associated item named `write_from` found
#![allow(unused_imports, unused_variables, unused_mut)]
use rdma_verbs::ah::AddressHandle;
use rdma_verbs::mr::{Mr, RemoteMr};
use rdma_verbs::qp::{Qp, Rts, Ud, UdSendWr};

fn f(qp: &mut Qp<Ud, Rts>, src: Mr, remote: RemoteMr, ah: &AddressHandle) {
    let _ = qp.post_send(UdSendWr::write_from(1, src, remote, 0)); // UD has no RDMA
}
fn main() {}

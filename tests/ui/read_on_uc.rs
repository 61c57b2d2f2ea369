//~ ERROR E0599 no function or associated item named `read` found
#![allow(unused_imports, unused_variables, unused_mut)]
use rdma_verbs::mr::{Mr, RemoteMr};
use rdma_verbs::qp::{Qp, Rts, Uc, UcSendWr};

fn f(qp: &mut Qp<Uc, Rts>, dest: Mr, remote: RemoteMr) {
    let _ = qp.post_send(UcSendWr::read(1, dest, remote, 0)); // UC has no RDMA READ
}
fn main() {}

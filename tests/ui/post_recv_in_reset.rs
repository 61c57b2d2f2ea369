//~ ERROR E0277 receives can be posted only from INIT on
#![allow(unused_imports, unused_variables, unused_mut)]
use rdma_verbs::cq::Cq;
use rdma_verbs::mr::{AccessFlags, Mr};
use rdma_verbs::qp::{Init, InitAttr, Qp, Rc, RecvWr, Reset, Rtr, Rts, SendWr};

fn f(qp: &mut Qp<Rc, Reset>, mr: Mr) {
    let _ = qp.post_recv(RecvWr::new(1, mr));
}
fn main() {}

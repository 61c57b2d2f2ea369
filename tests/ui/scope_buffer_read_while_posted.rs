//~ ERROR E0502 as mutable because it is also borrowed as immutable
#![allow(unused_imports, unused_variables, unused_mut)]
use rdma_verbs::Result;
use rdma_verbs::cq::Cq;
use rdma_verbs::mr::Mr;
use rdma_verbs::qp::{Qp, Rc, Rts};

// A received buffer's bytes cannot be held while it is lent to the NIC again.
fn f(cq: &mut Cq, qp: &mut Qp<Rc, Rts>, mr: &mut Mr) -> Result<()> {
    cq.scope(|s| {
        let q = s.attach(qp)?;
        let mut rx = q.buffers(mr, 64)?;
        let bytes = rx.bytes(0)?;
        rx.post_recv(0, 0)?;
        println!("{bytes:?}");
        Ok(())
    })
}
fn main() {}

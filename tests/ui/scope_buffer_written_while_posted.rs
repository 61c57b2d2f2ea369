//~ ERROR E0499 more than once at a time
#![allow(unused_imports, unused_variables, unused_mut)]
use rdma_verbs::Result;
use rdma_verbs::cq::Cq;
use rdma_verbs::mr::Mr;
use rdma_verbs::qp::{Qp, Rc, Rts};

// A buffer being written cannot be lent to the NIC at the same time.
fn f(cq: &mut Cq, qp: &mut Qp<Rc, Rts>, mr: &mut Mr) -> Result<()> {
    cq.scope(|s| {
        let q = s.attach(qp)?;
        let mut b = q.buffers(mr, 64)?;
        let bytes = b.bytes_mut(0)?;
        b.post_send(0, 8, 1)?;
        bytes[0] = 1;
        Ok(())
    })
}
fn main() {}

//~ ERROR E0499 more than once at a time
#![allow(unused_imports, unused_variables, unused_mut)]
use rdma_verbs::Result;
use rdma_verbs::cq::Cq;
use rdma_verbs::mr::{Mr, RemoteMr};
use rdma_verbs::qp::{Qp, Rc, Rts};
use rdma_verbs::qp::scope::{Dst, PreparedSends, ScopedSend};

// A list prepared before the scope keeps its destination lent: the closure
// cannot write it while READs may be landing there.
fn f(cq: &mut Cq, qp: &mut Qp<Rc, Rts>, mut mr: Mr, remote: RemoteMr) -> Result<()> {
    let list = PreparedSends::new([ScopedSend::read(0, Dst::new(&mut mr)?, remote, 0)])?;
    cq.scope(|s| {
        let mut q = s.attach(qp)?;
        q.post_prepared(&list, 1)?;
        mr.fill(0)?;
        Ok(())
    })
}
fn main() {}

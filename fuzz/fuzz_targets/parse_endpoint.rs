//! Fuzzes the out-of-band exchange parsers (`cargo +nightly fuzz run parse_endpoint`).
//!
//! Properties: no input panics; whatever parses re-encodes to something that
//! parses to the same value; the stream readers agree with the slice parsers.
#![no_main]

use std::io::Cursor;

use libfuzzer_sys::fuzz_target;
use rdma_verbs::exchange::{
    self, PeerInfo, WireMessage, encode_endpoint, encode_peer_info, parse_endpoint, parse_peer_info,
};
use rdma_verbs::qp::Endpoint;

fuzz_target!(|data: &[u8]| {
    if let Ok(ep) = parse_endpoint(data) {
        let wire = encode_endpoint(&ep).expect("a parsed endpoint re-encodes");
        assert_eq!(parse_endpoint(&wire).expect("re-parses"), ep);
    }
    let streamed = Endpoint::read_from(&mut Cursor::new(data));
    if data.len() == exchange::ENDPOINT_MSG_LEN {
        assert_eq!(streamed.is_ok(), parse_endpoint(data).is_ok());
    }
    if let Ok(info) = parse_peer_info(data) {
        let wire = encode_peer_info(&info).expect("parsed peer info re-encodes");
        assert_eq!(parse_peer_info(&wire).expect("re-parses"), info);
        let mut cur = Cursor::new(data);
        assert_eq!(PeerInfo::read_from(&mut cur).expect("stream parse"), info);
    }
    let _ = exchange::read_done(&mut Cursor::new(data));
});

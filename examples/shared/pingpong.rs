//! What the ports of rdma-core's `ibv_*_pingpong` share: their getopt_long
//! command line, the address lines they print, opening the device, the TCP
//! exchange of endpoints and the ping-pong loop. Included with `#[path]` by
//! each port.

use std::time::Duration;

#[path = "pingpong/options.rs"]
mod options;
#[path = "pingpong/ping_loop.rs"]
mod ping_loop;
#[path = "pingpong/setup.rs"]
mod setup;

pub use options::*;
pub use ping_loop::*;
pub use setup::*;

/// How long the client keeps trying to reach the server.
pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);

/// `wr_id` of every receive (as the C programs).
pub const RECV_WRID: u64 = 1;
/// `wr_id` of every send.
pub const SEND_WRID: u64 = 2;

/// `name`'s argument vector for the command line `line` (in tests).
#[cfg(test)]
pub fn test_args(name: &str, line: &str) -> Vec<String> {
    std::iter::once(name)
        .chain(line.split_whitespace())
        .map(str::to_owned)
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use rdma_verbs::device::Gid;

    #[test]
    fn c_long_reads_like_strtol() {
        assert_eq!(c_long("0x10"), Some(16));
        assert_eq!(c_long("010"), Some(8));
        assert_eq!(c_long("-1"), Some(-1));
        assert_eq!(c_long("x"), None);
    }

    #[test]
    fn ntop_matches_inet_ntop() {
        let g: Gid = "::ffff:10.99.0.1".parse().unwrap();
        assert_eq!(ntop(&g), "::ffff:10.99.0.1");
        assert_eq!(ntop(&Gid::ZERO), "::");
        assert_eq!(ntop(&"fe80::1".parse().unwrap()), "fe80::1");
    }
}

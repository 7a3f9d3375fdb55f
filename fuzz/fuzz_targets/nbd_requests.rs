//! The NBD transmission phase: a valid handshake, then arbitrary request bytes,
//! through the real connection and request engine over a socket pair.
//!
//! The first byte picks the device (bits 0-1: zero, linear, thin, writecache) and
//! what is negotiated (bits 2-3): structured replies; simple replies only;
//! structured replies and `base:allocation`; or structured replies,
//! `base:allocation` and `qemu:dirty-bitmap:1` (which only the thin, whose
//! snapshot 1 is its base, is given). Block status is fuzzed in the last two.
//!
//! The requests' cookies are rewritten to their index, so that every reply can
//! be matched to its request, and the replies are checked as they come: each
//! well formed (a READ answered in chunks once structured replies are on, a data
//! chunk inside its request, block-status chunks with non-empty descriptors, one
//! for REQ_ONE, from a selected context), each request answered at most once,
//! and, when the input ends at a request boundary or with DISC, every request
//! answered (a request left unanswered wedges its connection).
#![no_main]
#[path = "../common.rs"]
mod common;
use libfuzzer_sys::fuzz_target;
use std::io::{Read, Write};
use std::os::unix::net::UnixStream;

const MAGIC: u64 = 0x49484156454F5054; // IHAVEOPT
const REQUEST_MAGIC: u32 = 0x2560_9513;
const MAX_DISCARDED_PAYLOAD: u32 = 64 << 20;

fn option(out: &mut Vec<u8>, opt: u32, payload: &[u8]) {
    out.extend_from_slice(&MAGIC.to_be_bytes());
    out.extend_from_slice(&opt.to_be_bytes());
    out.extend_from_slice(&(payload.len() as u32).to_be_bytes());
    out.extend_from_slice(payload);
}

#[derive(Clone, Copy)]
struct Req {
    cmd: u16,
    flags: u16,
    offset: u64,
    len: u32,
}

/// The requests in `input` (cookies rewritten to their index in place), and
/// whether the input ends cleanly: at a request boundary or with DISC, with no
/// bad magic, cut payload or payload the server hangs up on before.
fn requests(input: &mut [u8]) -> (Vec<Req>, bool) {
    let mut reqs = Vec::new();
    let mut pos = 0;
    loop {
        if pos == input.len() {
            return (reqs, true);
        }
        if input.len() - pos < 28 {
            return (reqs, false);
        }
        let h = &mut input[pos..pos + 28];
        if u32::from_be_bytes([h[0], h[1], h[2], h[3]]) != REQUEST_MAGIC {
            return (reqs, false);
        }
        h[8..16].copy_from_slice(&(reqs.len() as u64).to_be_bytes());
        let r = Req {
            flags: u16::from_be_bytes([h[4], h[5]]),
            cmd: u16::from_be_bytes([h[6], h[7]]),
            offset: u64::from_be_bytes(h[16..24].try_into().unwrap()),
            len: u32::from_be_bytes([h[24], h[25], h[26], h[27]]),
        };
        pos += 28;
        if r.cmd == 2 {
            return (reqs, true); // DISC: nothing after it is read
        }
        // known before its payload: a write refused for its size is answered
        // while its payload is still being thrown away
        reqs.push(r);
        if r.cmd == 1 {
            if r.len > MAX_DISCARDED_PAYLOAD || ((input.len() - pos) as u64) < u64::from(r.len) {
                return (reqs, false);
            }
            pos += r.len as usize;
        }
    }
}

/// Reads exactly `n` bytes; None at the end of the stream.
fn take(rd: &mut UnixStream, n: usize) -> Option<Vec<u8>> {
    let mut b = vec![0u8; n];
    rd.read_exact(&mut b).ok()?;
    Some(b)
}

fn be32(b: &[u8]) -> u32 {
    u32::from_be_bytes(b[..4].try_into().unwrap())
}

/// Read the handshake's answers up to GO's; the context ids SET_META_CONTEXT gave.
fn handshake(rd: &mut UnixStream) -> Option<Vec<u32>> {
    take(rd, 18)?;
    let mut ids = Vec::new();
    loop {
        let h = take(rd, 20)?;
        let (opt, typ, len) = (be32(&h[8..]), be32(&h[12..]), be32(&h[16..]) as usize);
        assert!(len <= 1 << 16, "option reply of {len} bytes");
        let p = take(rd, len)?;
        if typ == 4 && opt == 10 {
            ids.push(be32(&p));
        }
        if opt == 7 && (typ == 1 || typ & 0x8000_0000 != 0) {
            assert_eq!(typ, 1, "GO refused");
            return Some(ids);
        }
    }
}

/// Check the replies against the requests until the server closes.
fn check_replies(rd: &mut UnixStream, reqs: &[Req], structured: bool, clean: bool) {
    let Some(ids) = handshake(rd) else { return };
    let mut done = vec![false; reqs.len()];
    while let Some(m) = take(rd, 4) {
        match be32(&m) {
            0x6744_6698 => {
                let Some(h) = take(rd, 12) else { break };
                let error = be32(&h);
                let cookie = u64::from_be_bytes(h[4..12].try_into().unwrap());
                let r = reqs
                    .get(cookie as usize)
                    .unwrap_or_else(|| panic!("reply to unknown cookie {cookie}"));
                assert!(!done[cookie as usize], "request {cookie} answered twice");
                done[cookie as usize] = true;
                if r.cmd == 0 && error == 0 {
                    assert!(
                        !structured,
                        "simple reply to READ {cookie} with structured replies on"
                    );
                    if take(rd, r.len as usize).is_none() {
                        break;
                    }
                }
            }
            0x668e_33ef => {
                assert!(structured, "structured reply without negotiation");
                let Some(h) = take(rd, 16) else { break };
                let flags = u16::from_be_bytes([h[0], h[1]]);
                let typ = u16::from_be_bytes([h[2], h[3]]);
                let cookie = u64::from_be_bytes(h[4..12].try_into().unwrap());
                let len = be32(&h[12..]) as usize;
                assert!(len <= (32 << 20) + 8, "chunk of {len} bytes");
                let r = *reqs
                    .get(cookie as usize)
                    .unwrap_or_else(|| panic!("chunk for unknown cookie {cookie}"));
                assert!(
                    !done[cookie as usize],
                    "chunk for request {cookie} after its DONE"
                );
                let Some(p) = take(rd, len) else { break };
                match typ {
                    0 => assert!(
                        len == 0 && flags & 1 != 0,
                        "NONE chunk of {len} bytes, flags {flags:#x}"
                    ),
                    1 => {
                        assert_eq!(r.cmd, 0, "data chunk for command {}", r.cmd);
                        assert!(len >= 9, "data chunk of {len} bytes");
                        let off = u64::from_be_bytes(p[..8].try_into().unwrap());
                        let end = off + (len as u64 - 8);
                        assert!(
                            off >= r.offset && end <= r.offset + u64::from(r.len),
                            "data chunk outside its read"
                        );
                    }
                    5 => {
                        assert_eq!(r.cmd, 7, "block status chunk for command {}", r.cmd);
                        assert!(
                            len >= 12 && (len - 4).is_multiple_of(8),
                            "block status chunk of {len} bytes"
                        );
                        assert!(
                            ids.contains(&be32(&p)),
                            "block status for context {} not selected",
                            be32(&p)
                        );
                        let n = (len - 4) / 8;
                        for k in 0..n {
                            assert_ne!(be32(&p[4 + 8 * k..]), 0, "empty extent");
                        }
                        if r.flags & 8 != 0 {
                            assert_eq!(n, 1, "REQ_ONE answered with {n} extents");
                            assert!(be32(&p[4..]) <= r.len, "REQ_ONE extent longer than the request");
                        }
                    }
                    0x8001 => assert!(len >= 6 && be32(&p) != 0, "error chunk of {len} bytes"),
                    t => panic!("chunk type {t:#x}"),
                }
                if flags & 1 != 0 {
                    done[cookie as usize] = true;
                }
            }
            x => panic!("reply magic {x:#x}"),
        }
    }
    if clean {
        if let Some(k) = done.iter().position(|d| !d) {
            panic!("request {k} (command {}) never answered", reqs[k].cmd);
        }
    }
}

fuzz_target!(|data: &[u8]| {
    let Some((&pick, rest)) = data.split_first() else {
        return;
    };
    let reg = &common::ctx().reg;
    let name: &[u8] = match pick % 4 {
        0 => b"z",
        1 => b"lin",
        2 => b"thin",
        _ => b"wc",
    };
    let mode = (pick >> 2) % 4;
    let structured = mode != 1;
    let mut hello = Vec::new();
    hello.extend_from_slice(&3u32.to_be_bytes()); // fixed newstyle, no zeroes
    if structured {
        option(&mut hello, 8, &[]); // STRUCTURED_REPLY
    }
    if mode >= 2 {
        let contexts: &[&[u8]] = if mode == 2 {
            &[b"base:allocation"]
        } else {
            &[b"base:allocation", b"qemu:dirty-bitmap:1"]
        };
        let mut set = Vec::new();
        set.extend_from_slice(&(name.len() as u32).to_be_bytes());
        set.extend_from_slice(name);
        set.extend_from_slice(&(contexts.len() as u32).to_be_bytes());
        for c in contexts {
            set.extend_from_slice(&(c.len() as u32).to_be_bytes());
            set.extend_from_slice(c);
        }
        option(&mut hello, 10, &set); // SET_META_CONTEXT
    }
    let mut go = Vec::new();
    go.extend_from_slice(&(name.len() as u32).to_be_bytes());
    go.extend_from_slice(name);
    go.extend_from_slice(&0u16.to_be_bytes());
    option(&mut hello, 7, &go); // GO
    let mut body = rest.to_vec();
    let (reqs, clean) = requests(&mut body);
    let Ok((server, client)) = UnixStream::pair() else {
        return;
    };
    let input: Vec<u8> = hello.into_iter().chain(body).collect();
    let mut wr = match client.try_clone() {
        Ok(c) => c,
        Err(_) => return,
    };
    let writer = std::thread::spawn(move || {
        let _ = wr.write_all(&input);
        let _ = wr.shutdown(std::net::Shutdown::Write);
    });
    let mut rd = client;
    let reader = std::thread::spawn(move || {
        check_replies(&mut rd, &reqs, structured, clean);
        let mut sink = [0u8; 1 << 16];
        while matches!(rd.read(&mut sink), Ok(n) if n > 0) {}
    });
    dmkit::export::nbd::serve_one(server, reg, "fuzz", &Default::default());
    let _ = writer.join();
    if let Err(e) = reader.join() {
        std::panic::resume_unwind(e);
    }
});

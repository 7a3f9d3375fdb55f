//! The least CPU an NBD server over a unix socket can spend per request on this
//! machine: a measuring stick for `bench/scaling.py`, not a server to use.
//!
//! One thread per client, one file. Each turn it receives everything the socket
//! holds with one blocking `recv`, answers every complete request with a plain
//! `pread`/`pwrite` into per-request buffers, and sends all the replies with one
//! `sendmsg`. No validation, no device mapping, no flush, no queue: what is left is
//! the kernel's part of the work (socket copies, page-cache copies and lookups,
//! wake-ups) that any server on this socket and this file pays.
//!
//! cargo run --release --example nbd_floor -- SOCKET FILE

use std::io::{Read, Write};
use std::os::fd::AsRawFd;
use std::os::unix::fs::FileExt;
use std::os::unix::net::{UnixListener, UnixStream};

const OPTS_MAGIC: u64 = 0x4948_4156_454F_5054; // "IHAVEOPT"
const REPLY_MAGIC: u64 = 0x0003_e889_0455_65a9;
const OPT_GO: u32 = 7;
const OPT_ABORT: u32 = 2;
const REP_ACK: u32 = 1;
const REP_INFO: u32 = 3;
const REP_ERR_UNSUP: u32 = (1 << 31) | 1;

fn opt_reply(s: &mut UnixStream, opt: u32, typ: u32, data: &[u8]) -> std::io::Result<()> {
    let mut b = Vec::with_capacity(20 + data.len());
    b.extend_from_slice(&REPLY_MAGIC.to_be_bytes());
    b.extend_from_slice(&opt.to_be_bytes());
    b.extend_from_slice(&typ.to_be_bytes());
    b.extend_from_slice(&(data.len() as u32).to_be_bytes());
    b.extend_from_slice(data);
    s.write_all(&b)
}

/// Fixed newstyle negotiation: every option but GO is refused; GO gets the size.
fn handshake(s: &mut UnixStream, size: u64) -> std::io::Result<bool> {
    s.write_all(b"NBDMAGIC")?;
    s.write_all(&OPTS_MAGIC.to_be_bytes())?;
    s.write_all(&3u16.to_be_bytes())?; // FIXED_NEWSTYLE | NO_ZEROES
    let mut flags = [0u8; 4];
    s.read_exact(&mut flags)?;
    loop {
        let mut h = [0u8; 16];
        s.read_exact(&mut h)?;
        let opt = u32::from_be_bytes([h[8], h[9], h[10], h[11]]);
        let len = u32::from_be_bytes([h[12], h[13], h[14], h[15]]);
        let mut data = vec![0u8; len.min(1 << 16) as usize];
        s.read_exact(&mut data)?;
        match opt {
            OPT_GO => {
                let mut info = Vec::new();
                info.extend_from_slice(&0u16.to_be_bytes()); // NBD_INFO_EXPORT
                info.extend_from_slice(&size.to_be_bytes());
                info.extend_from_slice(&1u16.to_be_bytes()); // HAS_FLAGS
                opt_reply(s, opt, REP_INFO, &info)?;
                opt_reply(s, opt, REP_ACK, &[])?;
                return Ok(true);
            }
            OPT_ABORT => return Ok(false),
            _ => opt_reply(s, opt, REP_ERR_UNSUP, &[])?,
        }
    }
}

fn serve(mut s: UnixStream, file: &std::fs::File, size: u64) -> std::io::Result<()> {
    if !handshake(&mut s, size)? {
        return Ok(());
    }
    let fd = s.as_raw_fd();
    let mut rbuf = vec![0u8; 1 << 20];
    let (mut rpos, mut rend) = (0usize, 0usize);
    let mut bufs: Vec<Vec<u8>> = (0..256).map(|_| vec![0u8; 4096]).collect();
    let mut hdrs = vec![[0u8; 16]; 256];
    let mut lens = vec![0usize; 256];
    let mut iov: Vec<libc::iovec> = Vec::with_capacity(512);
    loop {
        if rend == rbuf.len() {
            rbuf.copy_within(rpos..rend, 0);
            rend -= rpos;
            rpos = 0;
        }
        // SAFETY: the range is inside `rbuf`.
        let r = unsafe { libc::recv(fd, rbuf[rend..].as_mut_ptr().cast(), rbuf.len() - rend, 0) };
        if r <= 0 {
            return Ok(());
        }
        rend += r as usize;
        let mut n = 0;
        while rend - rpos >= 28 && n < bufs.len() {
            let h = &rbuf[rpos..rpos + 28];
            let cmd = u16::from_be_bytes([h[6], h[7]]);
            let off = u64::from_be_bytes(h[16..24].try_into().unwrap_or_default());
            let len = u32::from_be_bytes([h[24], h[25], h[26], h[27]]) as usize;
            let total = 28 + if cmd == 1 { len } else { 0 };
            if rend - rpos < total {
                break;
            }
            if cmd == 2 {
                return Ok(());
            }
            hdrs[n][..4].copy_from_slice(&0x6744_6698u32.to_be_bytes());
            hdrs[n][4..8].copy_from_slice(&0u32.to_be_bytes());
            hdrs[n][8..16].copy_from_slice(&h[8..16]);
            lens[n] = 0;
            if bufs[n].len() < len {
                bufs[n].resize(len, 0);
            }
            match cmd {
                0 => {
                    file.read_exact_at(&mut bufs[n][..len], off)?;
                    lens[n] = len;
                }
                1 => file.write_all_at(&rbuf[rpos + 28..rpos + 28 + len], off)?,
                _ => {}
            }
            rpos += total;
            n += 1;
        }
        if rpos == rend {
            (rpos, rend) = (0, 0);
        }
        iov.clear();
        for i in 0..n {
            iov.push(libc::iovec {
                iov_base: hdrs[i].as_mut_ptr().cast(),
                iov_len: 16,
            });
            if lens[i] > 0 {
                iov.push(libc::iovec {
                    iov_base: bufs[i].as_mut_ptr().cast(),
                    iov_len: lens[i],
                });
            }
        }
        let mut at = 0;
        while at < iov.len() {
            // SAFETY: msghdr is plain C data; the iovecs name live buffers.
            let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
            msg.msg_iov = iov[at..].as_mut_ptr();
            msg.msg_iovlen = (iov.len() - at) as _;
            // SAFETY: as above.
            let mut sent = unsafe { libc::sendmsg(fd, &msg, libc::MSG_NOSIGNAL) };
            if sent < 0 {
                return Err(std::io::Error::last_os_error());
            }
            while sent > 0 {
                let v = &mut iov[at];
                if sent as usize >= v.iov_len {
                    sent -= v.iov_len as isize;
                    at += 1;
                } else {
                    // SAFETY: advancing within the same buffer.
                    v.iov_base = unsafe { v.iov_base.cast::<u8>().add(sent as usize) }.cast();
                    v.iov_len -= sent as usize;
                    sent = 0;
                }
            }
        }
    }
}

fn main() -> std::io::Result<()> {
    let args: Vec<String> = std::env::args().collect();
    let (Some(sock), Some(path)) = (args.get(1), args.get(2)) else {
        eprintln!("usage: nbd_floor SOCKET FILE");
        std::process::exit(2);
    };
    let file = std::sync::Arc::new(std::fs::OpenOptions::new().read(true).write(true).open(path)?);
    let size = file.metadata()?.len();
    let _ = std::fs::remove_file(sock);
    let l = UnixListener::bind(sock)?;
    for s in l.incoming() {
        let (s, file) = (s?, file.clone());
        std::thread::spawn(move || {
            if let Err(e) = serve(s, &file, size) {
                eprintln!("nbd_floor: {e}");
            }
        });
    }
    Ok(())
}

//! TLS for the NBD export (NBD_OPT_STARTTLS), with OpenSSL.
//!
//! The credentials are nbdkit's: a directory of X.509 files (`ca-cert.pem`,
//! `server-cert.pem`, `server-key.pem`) or a pre-shared key file in psktool's
//! format (`identity:hexkey` a line). OpenSSL rather than rustls because rustls
//! has no external pre-shared keys, and the clients that matter here (libnbd and
//! qemu, both GnuTLS) offer PSK in TLS 1.3, which OpenSSL's PSK callback serves
//! (TLS 1.2 PSK suites are enabled too, for older clients).
//!
//! The TLS handshake and the options after it run on blocking I/O in the
//! connection's thread (`Session` over the socket); the transmission phase then
//! drives the same session from `Conn`'s loop: reads decrypt what non-blocking
//! receives bring, and writes encrypt into a buffer that `Conn` sends through its
//! ring ([`Session::recv`], [`Session::encrypt`], [`Session::take_output`]).

use anyhow::{bail, Context, Result};
use openssl::error::ErrorStack;
use openssl::ex_data::Index;
use openssl::nid::Nid;
use openssl::ssl::{
    ErrorCode, Ssl, SslContext, SslContextBuilder, SslFiletype, SslMethod, SslOptions, SslStream,
    SslVerifyMode, SslVersion,
};
use openssl::x509::X509Name;
use std::collections::{HashMap, HashSet};
use std::io::{self, Read, Write};
use std::os::fd::{AsFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// `--tls`: whether STARTTLS is offered, and whether it is required.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum Mode {
    /// No TLS: STARTTLS is answered NBD_REP_ERR_UNSUP.
    #[default]
    Off,
    /// STARTTLS is offered; clients without TLS are served too.
    On,
    /// Every option but STARTTLS and ABORT before TLS is answered NBD_REP_ERR_TLS_REQD.
    Require,
}

/// The TLS settings of `dmkit serve`.
#[derive(Clone, Debug, Default)]
pub struct Options {
    pub mode: Mode,
    /// `ca-cert.pem`, `server-cert.pem`, `server-key.pem`.
    pub certificates: Option<PathBuf>,
    /// Ask clients for a certificate signed by `ca-cert.pem`, and refuse those without.
    pub verify_peer: bool,
    /// psktool's key file.
    pub psk: Option<PathBuf>,
    /// `EXPORT=ID[,ID...]`: the TLS identities (PSK identity, or the common name
    /// of the client's certificate) that may see EXPORT; exports not named are
    /// open to every client.
    pub allow: Vec<String>,
}

/// The TLS side of the NBD server: the mode and, unless off, the context.
#[derive(Default)]
pub struct Tls {
    pub mode: Mode,
    ctx: Option<SslContext>,
    /// Where the PSK callback notes the client's identity.
    psk_identity: Option<Index<Ssl, String>>,
    /// Export -> the identities that may see it.
    allow: HashMap<String, HashSet<String>>,
}

/// Largest PSK file read: a key file of thousands of identities stays far below.
pub const MAX_PSK_FILE: u64 = 1 << 20;
/// Key and identity sizes OpenSSL's PSK callback can take.
const MAX_PSK_KEY: usize = 512;
const MAX_PSK_IDENTITY: usize = 256;

impl Tls {
    /// Check the options and load the credentials; errors name the file and line.
    pub fn new(o: &Options) -> Result<Tls> {
        if o.mode == Mode::Off {
            if o.certificates.is_some() || o.psk.is_some() || o.verify_peer || !o.allow.is_empty() {
                bail!("--tls-certificates, --tls-psk, --tls-verify-peer and --tls-allow need --tls on or --tls require");
            }
            return Ok(Tls::default());
        }
        if o.certificates.is_none() && o.psk.is_none() {
            bail!(
                "--tls {}: give --tls-certificates DIR or --tls-psk FILE",
                mode_name(o.mode)
            );
        }
        if o.certificates.is_some() && o.psk.is_some() {
            // Seen with both: qemu's PSK client (GnuTLS) was answered with a
            // certificate handshake and failed ("insufficient credentials").
            bail!("--tls-certificates and --tls-psk exclude each other: run one server for each");
        }
        if o.verify_peer && o.certificates.is_none() {
            bail!("--tls-verify-peer needs --tls-certificates (its ca-cert.pem signs the clients' certificates)");
        }
        let mut b = SslContextBuilder::new(SslMethod::tls_server()).context("creating the TLS context")?;
        b.set_min_proto_version(Some(SslVersion::TLS1_2))
            .context("setting the TLS version")?;
        // No session tickets: each connection is one session, and a ticket written
        // after the handshake would have to be sent from the transmission phase.
        b.set_options(
            SslOptions::NO_TICKET | SslOptions::IGNORE_UNEXPECTED_EOF | SslOptions::CIPHER_SERVER_PREFERENCE,
        );
        // TLS 1.3's mandatory suite first: AES-128-GCM costs the server less CPU per
        // byte than the AES-256-GCM or ChaCha20 that GnuTLS clients list first.
        b.set_ciphersuites("TLS_AES_128_GCM_SHA256:TLS_AES_256_GCM_SHA384:TLS_CHACHA20_POLY1305_SHA256")
            .context("setting the TLS 1.3 cipher suites")?;
        b.set_num_tickets(0).context("turning session tickets off")?;
        if let Some(dir) = &o.certificates {
            load_certificates(&mut b, dir, o.verify_peer)?;
        }
        let allow = parse_allow(&o.allow)?;
        if o.certificates.is_some() && !allow.is_empty() && !o.verify_peer {
            bail!("--tls-allow with certificates needs --tls-verify-peer (the identities are the clients' certificates' names)");
        }
        let mut psk_identity = None;
        if let Some(file) = &o.psk {
            let keys = Arc::new(read_psk_file(file)?);
            // TLS 1.2 PSK suites too, for clients that do not speak TLS 1.3
            b.set_cipher_list("DEFAULT:PSK")
                .context("enabling the PSK cipher suites")?;
            let idx = Ssl::new_ex_index::<String>().context("making room for the PSK identity")?;
            psk_identity = Some(idx);
            b.set_psk_server_callback(move |ssl, identity, out| {
                let n = psk_lookup(&keys, identity, out)?;
                if n > 0 {
                    let id = String::from_utf8_lossy(identity.unwrap_or_default()).into_owned();
                    ssl.set_ex_data(idx, id);
                }
                Ok(n)
            });
        }
        Ok(Tls {
            mode: o.mode,
            ctx: Some(b.build()),
            psk_identity,
            allow,
        })
    }

    /// The TLS handshake on `sock` (blocking, under the handshake's deadline),
    /// right after the server's ACK to NBD_OPT_STARTTLS.
    pub fn accept(&self, sock: impl AsFd) -> io::Result<Session> {
        let ctx = self
            .ctx
            .as_ref()
            .ok_or_else(|| io::Error::other("STARTTLS accepted without a TLS context"))?;
        let ssl = Ssl::new(ctx).map_err(io::Error::other)?;
        let io = Wire::new(sock.as_fd().try_clone_to_owned()?);
        let mut stream = SslStream::new(ssl, io).map_err(io::Error::other)?;
        stream
            .accept()
            .map_err(|e| io::Error::new(io::ErrorKind::InvalidData, format!("TLS handshake: {e}")))?;
        Ok(Session { stream })
    }

    /// The client's identity: its PSK identity, or the common name of the
    /// certificate it showed.
    pub fn peer(&self, session: &Session) -> Option<String> {
        let ssl = session.stream.ssl();
        if let Some(id) = self.psk_identity.and_then(|idx| ssl.ex_data(idx)) {
            return Some(id.clone());
        }
        let cert = ssl.peer_certificate()?;
        let cn = cert.subject_name().entries_by_nid(Nid::COMMONNAME).next()?;
        cn.data().to_string().ok()
    }

    /// Whether a client of identity `peer` (None: no TLS, or no identity) may
    /// see `export`.
    pub fn visible(&self, peer: Option<&str>, export: &str) -> bool {
        match self.allow.get(export) {
            None => true,
            Some(ids) => peer.is_some_and(|p| ids.contains(p)),
        }
    }
}

/// `--tls-allow EXPORT=ID[,ID...]` values, an export at most once.
fn parse_allow(values: &[String]) -> Result<HashMap<String, HashSet<String>>> {
    let mut allow = HashMap::new();
    for v in values {
        let Some((export, ids)) = v.split_once('=') else {
            bail!("--tls-allow {v}: EXPORT=ID[,ID...] expected");
        };
        let ids: HashSet<String> = ids
            .split(',')
            .filter(|i| !i.is_empty())
            .map(String::from)
            .collect();
        if export.is_empty() || ids.is_empty() {
            bail!("--tls-allow {v}: an export name and at least one identity expected");
        }
        if allow.insert(export.to_string(), ids).is_some() {
            bail!("--tls-allow: export '{export}' given twice (list its identities in one)");
        }
    }
    Ok(allow)
}

fn mode_name(m: Mode) -> &'static str {
    match m {
        Mode::Off => "off",
        Mode::On => "on",
        Mode::Require => "require",
    }
}

fn load_certificates(b: &mut SslContextBuilder, dir: &Path, verify_peer: bool) -> Result<()> {
    let cert = dir.join("server-cert.pem");
    let key = dir.join("server-key.pem");
    let ca = dir.join("ca-cert.pem");
    b.set_certificate_chain_file(&cert)
        .with_context(|| format!("loading the server certificate {}", cert.display()))?;
    b.set_private_key_file(&key, SslFiletype::PEM)
        .with_context(|| format!("loading the server key {}", key.display()))?;
    b.check_private_key()
        .with_context(|| format!("{} is not the key of {}", key.display(), cert.display()))?;
    if verify_peer {
        b.set_ca_file(&ca)
            .with_context(|| format!("loading the CA certificate {}", ca.display()))?;
        let names = X509Name::load_client_ca_file(&ca)
            .with_context(|| format!("reading the CA names of {}", ca.display()))?;
        b.set_client_ca_list(names);
        b.set_verify(SslVerifyMode::PEER | SslVerifyMode::FAIL_IF_NO_PEER_CERT);
    }
    Ok(())
}

/// psktool's key file: `identity:hexkey` a line (empty lines are skipped), at most
/// [`MAX_PSK_FILE`] bytes.
pub fn read_psk_file(path: &Path) -> Result<HashMap<Vec<u8>, Vec<u8>>> {
    let f = std::fs::File::open(path).with_context(|| format!("opening the PSK file {}", path.display()))?;
    let mut text = String::new();
    f.take(MAX_PSK_FILE + 1)
        .read_to_string(&mut text)
        .with_context(|| format!("reading the PSK file {} (text expected)", path.display()))?;
    if text.len() as u64 > MAX_PSK_FILE {
        bail!("{}: a PSK file is at most {MAX_PSK_FILE} bytes", path.display());
    }
    parse_psk(&text).map_err(|e| anyhow::anyhow!("{}: {e}", path.display()))
}

/// The keys of a PSK file's text; errors name the line.
pub fn parse_psk(text: &str) -> Result<HashMap<Vec<u8>, Vec<u8>>, String> {
    let mut keys = HashMap::new();
    for (i, line) in text.lines().enumerate() {
        let n = i + 1;
        if line.trim().is_empty() {
            continue;
        }
        let Some((id, hex)) = line.rsplit_once(':') else {
            return Err(format!("line {n}: 'identity:hexkey' expected"));
        };
        if id.is_empty() || id.len() > MAX_PSK_IDENTITY {
            return Err(format!(
                "line {n}: the identity must be 1 to {MAX_PSK_IDENTITY} bytes"
            ));
        }
        let key = hex::decode(hex.trim_end())
            .ok()
            .ok_or_else(|| format!("line {n}: the key is not hexadecimal"))?;
        if key.is_empty() || key.len() > MAX_PSK_KEY {
            return Err(format!("line {n}: the key must be 1 to {MAX_PSK_KEY} bytes"));
        }
        if keys.insert(id.as_bytes().to_vec(), key).is_some() {
            return Err(format!("line {n}: identity '{id}' given twice"));
        }
    }
    if keys.is_empty() {
        return Err("no keys".into());
    }
    Ok(keys)
}

/// OpenSSL's PSK callback: the key of `identity`, or 0 bytes (unknown: the
/// handshake fails).
fn psk_lookup(
    keys: &HashMap<Vec<u8>, Vec<u8>>,
    identity: Option<&[u8]>,
    out: &mut [u8],
) -> Result<usize, ErrorStack> {
    let Some(key) = identity.and_then(|id| keys.get(id)) else {
        tracing::info!(
            "nbd: TLS client with unknown PSK identity '{}'",
            String::from_utf8_lossy(identity.unwrap_or_default())
        );
        return Ok(0);
    };
    if key.len() > out.len() {
        return Ok(0);
    }
    out[..key.len()].copy_from_slice(key);
    Ok(key.len())
}

/// The socket under a TLS session: blocking reads and writes through the
/// handshake; non-blocking reads and buffered writes once `Conn` drives it.
struct Wire {
    fd: OwnedFd,
    /// Transmission phase: reads do not wait, writes go to `out`.
    buffered: bool,
    rbuf: Box<[u8]>,
    rpos: usize,
    rend: usize,
    out: Vec<u8>,
    /// Records may go to the socket as they are made ([`Session::direct`]).
    direct: bool,
}

/// Bytes read from the socket at once: several TLS records.
const WIRE_READ: usize = 64 << 10;

impl Wire {
    fn new(fd: OwnedFd) -> Wire {
        Wire {
            fd,
            buffered: false,
            rbuf: vec![0; WIRE_READ].into_boxed_slice(),
            rpos: 0,
            rend: 0,
            out: Vec::new(),
            direct: false,
        }
    }
}

impl Read for Wire {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        if self.rpos == self.rend {
            let flags = if self.buffered {
                rustix::net::RecvFlags::DONTWAIT
            } else {
                rustix::net::RecvFlags::empty()
            };
            let (n, _) = rustix::net::recv(&self.fd, &mut self.rbuf[..], flags)?;
            self.rpos = 0;
            self.rend = n;
            if n == 0 {
                return Ok(0);
            }
        }
        let n = buf.len().min(self.rend - self.rpos);
        buf[..n].copy_from_slice(&self.rbuf[self.rpos..self.rpos + n]);
        self.rpos += n;
        Ok(n)
    }
}

impl Write for Wire {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        if self.buffered {
            // Straight from OpenSSL's record to the socket while nothing waits
            // before it (one copy fewer); what the socket has no room for waits
            // in `out` for the ring.
            let mut sent = 0;
            while self.direct && self.out.is_empty() && sent < buf.len() {
                let flags = rustix::net::SendFlags::NOSIGNAL | rustix::net::SendFlags::DONTWAIT;
                match rustix::net::send(&self.fd, &buf[sent..], flags) {
                    Ok(n) => sent += n,
                    Err(rustix::io::Errno::INTR) => {}
                    Err(rustix::io::Errno::AGAIN) => break,
                    Err(e) => return Err(e.into()),
                }
                if sent < buf.len() {
                    break; // the socket is full: the rest goes through the ring
                }
            }
            self.out.extend_from_slice(&buf[sent..]);
            return Ok(buf.len());
        }
        Ok(rustix::net::send(
            &self.fd,
            buf,
            rustix::net::SendFlags::NOSIGNAL,
        )?)
    }
    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

/// One client's TLS session.
pub struct Session {
    stream: SslStream<Wire>,
}

impl Read for Session {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        self.stream.read(buf)
    }
}

impl Write for Session {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        self.stream.write(buf)
    }
    fn flush(&mut self) -> io::Result<()> {
        self.stream.flush()
    }
}

impl Session {
    /// The protocol version and cipher suite negotiated, for the log.
    pub fn version(&self) -> String {
        let ssl = self.stream.ssl();
        let cipher = ssl.current_cipher().map_or("no cipher", |c| c.name());
        format!("{}, {cipher}", ssl.version_str())
    }

    /// From here on reads do not wait and writes are buffered for `Conn` to send.
    pub fn to_transmission(&mut self) {
        self.stream.get_mut().buffered = true;
    }

    /// Decrypt into `buf` what the socket has, as a non-blocking receive would:
    /// Ok(n > 0) bytes (fewer than asked only when the socket has no more for
    /// now), Ok(0) at the end of the stream, Err(EAGAIN) when nothing is there,
    /// Err(errno) when the session failed.
    pub fn recv(&mut self, buf: &mut [u8]) -> Result<usize, i32> {
        let mut got = 0;
        while got < buf.len() {
            match self.stream.ssl_read(&mut buf[got..]) {
                Ok(0) => return Ok(got),
                Ok(n) => got += n,
                Err(e) => {
                    let errno = match e.code() {
                        ErrorCode::ZERO_RETURN => 0,
                        ErrorCode::WANT_READ => libc::EAGAIN,
                        ErrorCode::SYSCALL if e.io_error().is_none() => 0,
                        _ => {
                            let errno = e
                                .io_error()
                                .and_then(|e| e.raw_os_error())
                                .unwrap_or(libc::EPROTO);
                            tracing::info!("nbd: TLS receive failed: {e}");
                            errno
                        }
                    };
                    return match errno {
                        // the end of the stream shows on the next call
                        0 | libc::EAGAIN if got > 0 => Ok(got),
                        0 => Ok(0),
                        // a failed session ends the connection now: no later
                        // wake-up would come to report it
                        _ => Err(errno),
                    };
                }
            }
        }
        Ok(got)
    }

    /// Encrypt `data` into the output buffer.
    pub fn encrypt(&mut self, mut data: &[u8]) -> Result<(), i32> {
        while !data.is_empty() {
            match self.stream.ssl_write(data) {
                Ok(n) => data = &data[n..],
                Err(e) => {
                    tracing::info!("nbd: TLS send failed: {e}");
                    return Err(libc::EPROTO);
                }
            }
        }
        Ok(())
    }

    /// Let records go to the socket as they are made (only while nothing of
    /// the connection's is being sent through the ring).
    pub fn direct(&mut self, on: bool) {
        self.stream.get_mut().direct = on;
    }

    /// Whether encrypted bytes wait to be sent (replies, or what reading made the
    /// session answer, such as a key update).
    pub fn has_output(&self) -> bool {
        !self.stream.get_ref().out.is_empty()
    }

    /// Move the encrypted bytes waiting into `into` (emptied first), leaving
    /// `into`'s old buffer in their place.
    pub fn take_output(&mut self, into: &mut Vec<u8>) {
        into.clear();
        std::mem::swap(into, &mut self.stream.get_mut().out);
    }
}

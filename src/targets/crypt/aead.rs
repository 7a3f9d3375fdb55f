//! dm-crypt's integrity modes: each encryption sector's tag lives on the
//! integrity device below (the kernel's DM-DIF-EXT-TAG profile, dmkit's
//! [`crate::mapper::Tags`]), as `cryptsetup luksFormat --integrity` sets up.
//!
//! - `integrity:<bytes>:aead` with `capi:authenc(hmac(sha256),<cipher>)-<iv>`:
//!   the kernel's `authenc` AEAD. A sector is encrypted with its IV, then
//!   authenticated: HMAC-SHA-256 over the associated data (the sector's
//!   number, le64, in 512-byte units from the target's start, then the
//!   16-byte IV) and the ciphertext, cut to the auth size. The tag is that
//!   MAC, then the IV for `random` IVs, then zeroes to `<bytes>`; the auth
//!   size is `<bytes>` less the IV kept there. A read whose MAC does not
//!   match fails with EILSEQ (the kernel's "INTEGRITY AEAD ERROR").
//! - `integrity:<bytes>:none` with a `random` IV: the tag keeps the IV only
//!   (no authentication).
//!
//! The table's key is the cipher's key followed by the MAC's (32 bytes for
//! hmac(sha256)), as dm-crypt splits it.
//!
//! Crates: `hmac` over `sha2` (RustCrypto's; sha2 uses the CPU's SHA
//! instructions where it has them), keyed once per key and cloned per sector;
//! its tag check is constant-time. `openssl`'s `rand_bytes` for random IVs.

use crate::mapper::TargetError;
use hmac::{Hmac, KeyInit, Mac};
use sha2::Sha256;

/// The MAC an `authenc(...)` cipher adds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Auth {
    HmacSha256,
}

impl Auth {
    /// Bytes of the MAC's key at the end of the table's key (the digest's
    /// size, dm-crypt's key_mac_size).
    pub(super) fn key_len(self) -> usize {
        match self {
            Auth::HmacSha256 => 32,
        }
    }

    /// The longest tag it makes.
    pub(super) fn digest_len(self) -> usize {
        match self {
            Auth::HmacSha256 => 32,
        }
    }
}

/// `authenc(<mac>,<cipher>)`: the MAC and the cipher's API name; None if
/// the API is not an authenc one, Err for one dmkit does not have.
pub(super) fn split_authenc(api: &str) -> Option<Result<(Auth, &str), String>> {
    let inner = api.strip_prefix("authenc(")?.strip_suffix(')')?;
    let Some((mac, cipher)) = inner.split_once(',') else {
        return Some(Err(format!("Bad cipher specification 'authenc({inner})'")));
    };
    Some(match mac {
        "hmac(sha256)" => Ok((Auth::HmacSha256, cipher)),
        _ => Err(format!(
            "Error allocating crypto tfm: authenc with '{mac}' is not supported by dmkit (hmac(sha256))"
        )),
    })
}

/// The table's `integrity:<bytes>:<aead|none>` (crypt_ctr_optional;
/// printed back in lower case, where the kernel keeps the case given).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Integrity {
    /// Bytes of tag a sector on the device below (on_disk_tag_size).
    pub(super) tag_size: u32,
    pub(super) aead: bool,
}

/// The kernel's limit on a tag (MAX_TAG_SIZE).
const MAX_TAG_SIZE: u32 = 255;

impl Integrity {
    /// `v` after `integrity:`.
    pub(super) fn parse(v: &str) -> Result<Integrity, String> {
        let (n, word) = v.split_once(':').ok_or("Invalid integrity arguments")?;
        let tag_size = n
            .parse::<u32>()
            .ok()
            .filter(|&t| t > 0 && t <= MAX_TAG_SIZE)
            .ok_or("Invalid integrity arguments")?;
        let aead = if word.eq_ignore_ascii_case("aead") {
            true
        } else if word.eq_ignore_ascii_case("none") {
            false
        } else {
            return Err(format!("Unknown integrity profile '{word}'"));
        };
        Ok(Integrity { tag_size, aead })
    }

    /// As the table shows it.
    pub(super) fn word(&self) -> String {
        format!("integrity:{}:{}", self.tag_size, if self.aead { "aead" } else { "none" })
    }
}

/// Where a sector's tag keeps what: its MAC's bytes first, then the IV if
/// it is kept there.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct TagLayout {
    pub(super) on_disk: usize,
    /// Bytes of MAC (0: no authentication).
    pub(super) auth: usize,
    /// The IV (random) follows the MAC.
    pub(super) iv_kept: bool,
}

/// An AEAD cipher needs `integrity:<bytes>:aead` and the other way round
/// (the kernel fails to allocate the cipher otherwise).
pub(super) fn check_pairing(integrity: &Integrity, auth: Option<Auth>) -> Result<(), String> {
    match (integrity.aead, auth) {
        (true, None) => Err("Error allocating crypto tfm: integrity:<bytes>:aead needs an AEAD cipher \
             (capi:authenc(hmac(sha256),<cipher>)-<iv>)"
            .into()),
        (false, Some(_)) => Err("Error allocating crypto tfm: an authenc cipher needs integrity:<bytes>:aead".into()),
        _ => Ok(()),
    }
}

impl TagLayout {
    /// The tag layout of `integrity` (paired with its cipher:
    /// [`check_pairing`]) for a cipher with MAC `auth` and an IV kept in the
    /// tag or not, with dm-crypt's errors (crypt_integrity_ctr's last ones).
    pub(super) fn new(integrity: &Integrity, auth: Option<Auth>, iv_kept: bool) -> Result<TagLayout, String> {
        check_pairing(integrity, auth)?;
        let on_disk = integrity.tag_size as usize;
        let iv = if iv_kept { 16 } else { 0 };
        let mac = match auth {
            Some(a) => {
                let m = on_disk.saturating_sub(iv);
                if m == 0 || m > a.digest_len() {
                    return Err("Integrity AEAD auth tag size is not supported.".into());
                }
                m
            }
            None => 0,
        };
        if mac + iv > on_disk {
            return Err("Not enough space for integrity tag in the profile.".into());
        }
        Ok(TagLayout {
            on_disk,
            auth: mac,
            iv_kept,
        })
    }
}

/// The MAC keyed once (its key's pads hashed), in the target's locked keys.
pub(super) struct MacKey(Hmac<Sha256>);

impl MacKey {
    pub(super) fn new(auth: Auth, key: &[u8]) -> Result<MacKey, TargetError> {
        match auth {
            Auth::HmacSha256 => Ok(MacKey(
                <Hmac<Sha256> as KeyInit>::new_from_slice(key).map_err(|_| "the MAC key is invalid".to_string())?,
            )),
        }
    }

    fn over(&self, sector: u64, iv: &[u8; 16], ct: &[u8]) -> Hmac<Sha256> {
        let mut m = self.0.clone();
        m.update(&sector.to_le_bytes());
        m.update(iv);
        m.update(ct);
        m
    }

    /// The MAC of a sector (`sector` in 512-byte units from the target's
    /// start, its IV, its ciphertext), its first `out.len()` bytes.
    pub(super) fn tag(&self, sector: u64, iv: &[u8; 16], ct: &[u8], out: &mut [u8]) {
        let full = self.over(sector, iv, ct).finalize().into_bytes();
        let n = out.len().min(full.len());
        out[..n].copy_from_slice(&full[..n]);
    }

    /// Whether `tag` is the first bytes of the sector's MAC (constant time).
    pub(super) fn check(&self, sector: u64, iv: &[u8; 16], ct: &[u8], tag: &[u8]) -> bool {
        self.over(sector, iv, ct).verify_truncated_left(tag).is_ok()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn integrity_options_parse_as_the_kernels() {
        let i = Integrity::parse("32:aead").unwrap();
        assert_eq!((i.tag_size, i.aead, i.word().as_str()), (32, true, "integrity:32:aead"));
        assert!(!Integrity::parse("16:none").unwrap().aead);
        for bad in ["0:aead", "256:aead", "x:aead", "32", "32:hmac"] {
            assert!(Integrity::parse(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn tag_layouts_check_sizes_as_dm_crypt() {
        let aead = |n| Integrity::parse(&format!("{n}:aead")).unwrap();
        let a = Some(Auth::HmacSha256);
        assert_eq!(
            TagLayout::new(&aead(32), a, false),
            Ok(TagLayout {
                on_disk: 32,
                auth: 32,
                iv_kept: false
            })
        );
        assert_eq!(TagLayout::new(&aead(48), a, true).map(|t| t.auth), Ok(32));
        assert_eq!(TagLayout::new(&aead(28), a, true).map(|t| t.auth), Ok(12));
        assert!(TagLayout::new(&aead(49), a, true).is_err(), "a MAC longer than the digest");
        assert!(TagLayout::new(&aead(16), a, true).is_err(), "no room for a MAC");
        assert!(TagLayout::new(&aead(32), None, false).is_err());
        let none = Integrity::parse("16:none").unwrap();
        assert_eq!(TagLayout::new(&none, None, true).map(|t| t.auth), Ok(0));
        assert!(TagLayout::new(&Integrity::parse("8:none").unwrap(), None, true).is_err());
    }

    /// The MAC is RFC 4231's HMAC-SHA-256 over le64(sector) || IV || data.
    #[test]
    fn the_mac_is_hmac_sha256_over_sector_iv_and_ciphertext() {
        // RFC 4231 test case 2: key "Jefe", data "what do ya want for nothing?"
        let m = MacKey::new(Auth::HmacSha256, b"Jefe").unwrap();
        let data = b"what do ya want for nothing?";
        // split the message as the MAC reads it: 8 bytes, 16 bytes, the rest
        let sector = u64::from_le_bytes(data[..8].try_into().unwrap());
        let iv: [u8; 16] = data[8..24].try_into().unwrap();
        let mut out = [0u8; 32];
        m.tag(sector, &iv, &data[24..], &mut out);
        assert_eq!(
            hex::encode(out),
            "5bdcc146bf60754e6a042426089575c75a003f089d2739839dec58b964ec3843"
        );
        assert!(m.check(sector, &iv, &data[24..], &out[..12]));
        out[3] ^= 1;
        assert!(!m.check(sector, &iv, &data[24..], &out));
    }
}

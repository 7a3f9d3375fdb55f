//! `thin_restore`: build metadata from thin_dump XML through the API.

use super::error::{Result, ThinError};
use super::metadata::{FormatOptions, ThinPoolMetadata, DEFAULT_CACHE_BLOCKS};
use super::progress::Progress;
use super::superblock::DeviceDetails;
use super::xml::{XmlDevice, XmlMetadata};
use crate::pdata::MetadataDev;

/// Build `md_xml` on `dev`; `progress` shows a progress line on stderr if it is a terminal.
pub fn restore(md_xml: &XmlMetadata, dev: Box<dyn MetadataDev>, progress: bool) -> Result<ThinPoolMetadata> {
    let sb = &md_xml.superblock;
    let mut md = ThinPoolMetadata::format(
        dev,
        FormatOptions {
            data_block_size: sb.data_block_size,
            nr_data_blocks: sb.nr_data_blocks,
            cache_blocks: DEFAULT_CACHE_BLOCKS,
        },
    )?;
    md.set_time(sb.time);
    md.set_transaction_id(0, sb.transaction)?;
    md.set_flags(sb.flags);
    md.set_version(sb.version);
    md.set_uuid(&sb.uuid);
    let total = md_xml.devices.iter().map(XmlDevice::nr_blocks).sum();
    let mut prog = Progress::new("restoring mappings", total, progress);
    for d in &md_xml.devices {
        md.create_thin(d.dev_id)?;
        let mut prev = None;
        for (v, b, t) in d.blocks() {
            if prev.is_some_and(|p| p >= v) {
                return Err(ThinError::Invalid(format!(
                    "device {}: mappings not in ascending order at block {v}",
                    d.dev_id
                )));
            }
            prev = Some(v);
            md.insert_shared(d.dev_id, v, b, t)?;
            prog.tick(1);
        }
        md.set_device_details(
            d.dev_id,
            DeviceDetails {
                mapped_blocks: 0,
                transaction_id: d.transaction,
                creation_time: d.creation_time,
                snapshotted_time: d.snap_time,
            },
        )?;
    }
    md.commit()?;
    Ok(md)
}

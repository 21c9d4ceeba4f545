"""Zero the payload of every CUDA fatbin entry whose SM arch is not kept, in place.

usage: python3 prune_fatbin.py FILE.so [KEEP_ARCHS=90]   (comma-separated, e.g. 90 or 80,90)

Headers are left intact, so the ELF and fatbin layout is unchanged; only the bytes of entries for other
GPUs become zeros (which then compress to almost nothing). Kept: cubins whose arch is in KEEP, and every
PTX entry whose arch is <= max(KEEP), so a kernel built only for older GPUs can still be JIT-compiled from
its PTX. Validated only by loading on the target GPU (the H200, sm_90): use it for nothing else.
(From the workplace's GPU recipe, `build_vllm_h200_payload.sh`; reformatted, same logic.)
"""

from __future__ import annotations

import struct
import sys
from pathlib import Path

FATBIN_MAGIC = 0xBA55ED50
PTX_KIND = 1


def prune(path: Path, keep: set[int]) -> tuple[int, int]:
    """(bytes kept, bytes zeroed) over every `.nv_fatbin` section of the ELF file at `path`."""
    data = bytearray(path.read_bytes())
    e_shoff = struct.unpack_from("<Q", data, 0x28)[0]
    e_shentsize, e_shnum, e_shstrndx = struct.unpack_from("<HHH", data, 0x3A)
    sections = [struct.unpack_from("<IIQQQQIIQQ", data, e_shoff + i * e_shentsize) for i in range(e_shnum)]
    names_at = sections[e_shstrndx][4]
    kept = zeroed = 0
    for section in sections:
        start = names_at + section[0]
        if data[start:data.index(0, start)].decode() != ".nv_fatbin":
            continue
        offset, size = section[4], section[5]
        p = offset
        while p < offset + size - 16:
            magic, _version, header_size, fat_size = struct.unpack_from("<IHHQ", data, p)
            if magic != FATBIN_MAGIC:
                p += 8
                continue
            q = p + header_size
            end = q + fat_size
            while q < end:
                kind, _, entry_header, payload = struct.unpack_from("<HHIQ", data, q)
                arch = struct.unpack_from("<I", data, q + 28)[0]
                if arch in keep or (kind == PTX_KIND and arch <= max(keep)):
                    kept += payload
                else:
                    data[q + entry_header:q + entry_header + payload] = bytes(payload)
                    zeroed += payload
                q += entry_header + payload
            p = end
    path.write_bytes(data)
    return kept, zeroed


def main() -> int:
    path = Path(sys.argv[1])
    keep = {int(a) for a in (sys.argv[2] if len(sys.argv) > 2 else "90").split(",")}
    kept, zeroed = prune(path, keep)
    print(f"{path.name}: kept {kept / 1e6:.1f} MB (sm {sorted(keep)}), zeroed {zeroed / 1e6:.1f} MB")
    return 0


if __name__ == "__main__":
    sys.exit(main())

// Types of voicewire.js, the voicewire browser client. Wire contract: docs/protocol.md.

export declare const STREAM_PATH: "/v1/audio/speech/stream";

export type ResponseFormat = "pcm" | "wav" | "mulaw" | "alaw" | "flac" | "mp3" | "opus";
export type DecodableFormat = "pcm" | "wav" | "mulaw" | "alaw";

/** `session.config` fields (all optional; null/undefined fields are not sent). */
export interface SessionConfig {
  model?: string;
  voice?: string;
  speaker?: string;
  language?: string;
  instructions?: string;
  speed?: number;
  response_format?: ResponseFormat;
  sample_rate?: number;
  stream_audio?: boolean;
  split_granularity?: "none" | "sentence" | "clause";
  max_buffer_delay_ms?: number;
  word_timestamps?: boolean;
  audio_frames?: "binary" | "json";
  [field: string]: unknown;
}

/** pcm16 streamed in binary frames, a unit per sentence: what `configure()` sends unless overridden. */
export declare const STREAMING_DEFAULTS: Readonly<SessionConfig>;
export declare const DECODABLE_FORMATS: readonly DecodableFormat[];

export interface WordTiming {
  word: string;
  /** ms from the utterance's first sample */
  start_ms: number;
  end_ms: number;
  /** offsets into the utterance text (all sendText deltas of the utterance, concatenated) */
  char_start: number;
  char_end: number;
}

export interface EngineDescription {
  name: string;
  /** Every name `model` may take: the engine, its model's ids, the aliases. */
  models: string[];
  sample_rate: number;
  voices: string[];
  default_voice: string;
  languages: string[];
  word_timestamps: boolean;
  voice_cloning: boolean;
  native_speed: number[];
}

export interface SessionUpdatedEvent {
  type: "session.updated";
  session_id: string;
  config: Required<Pick<SessionConfig, "model" | "voice" | "speed" | "response_format" | "sample_rate">> & SessionConfig;
  limits: Record<string, number>;
  engine: EngineDescription;
  /** Resumes this session on a new connection (the client does it by itself). */
  resume_token: string;
}

export interface AudioStartEvent {
  type: "audio.start";
  utterance_index: number;
  sentence_index: number;
  sentence_text: string;
  format: ResponseFormat;
  sample_rate: number;
  channels: number;
  context_id?: string;
}

export interface AudioChunkEvent {
  type: "audio.chunk";
  utterance_index: number;
  sentence_index: number;
  chunk_id: number;
  chunk_start_ms: number;
  chunk_end_ms: number;
  sample_rate: number;
  channels: number;
  audio_b64: string;
  timestamps: WordTiming[] | null;
}

export interface AudioWordsEvent {
  type: "audio.words";
  utterance_index: number;
  sentence_index: number;
  words: WordTiming[];
}

export interface AudioDoneEvent {
  type: "audio.done";
  utterance_index: number;
  sentence_index: number;
  total_bytes: number;
  error: boolean;
  audio_ms: number;
}

export interface SessionDoneEvent {
  type: "session.done";
  utterance_index: number;
  total_sentences: number;
  audio_ms: number;
  timings: { first_audio_ms: number | null; engine_ms: number };
}

export interface AudioCancelledEvent {
  type: "audio.cancelled";
  utterance_index: number;
  audio_ms: number;
  context_id?: string;
}

export interface ErrorEvent {
  type: "error";
  code: string;
  message: string;
  fatal: boolean;
  param?: string;
  partial_audio?: boolean;
  action?: string;
  utterance_index?: number;
  sentence_index?: number;
}

export type ServerEvent =
  | SessionUpdatedEvent
  | AudioStartEvent
  | AudioChunkEvent
  | AudioWordsEvent
  | AudioDoneEvent
  | SessionDoneEvent
  | AudioCancelledEvent
  | ErrorEvent;

/** One piece of audio in the negotiated format, of the unit announced by the last audio.start. */
export interface AudioPiece {
  utteranceIndex: number;
  sentenceIndex: number;
  format: ResponseFormat;
  sampleRate: number;
  data: ArrayBuffer;
}

export interface CloseDetail {
  code: number;
  reason: string;
  /** A sentence for people: the fatal error event if there was one, else the code's meaning. */
  message: string;
  error: ErrorEvent | null;
}

export interface ClientEventMap {
  "session.updated": SessionUpdatedEvent;
  "audio.start": AudioStartEvent;
  "audio.chunk": AudioChunkEvent;
  "audio.words": AudioWordsEvent;
  "audio.done": AudioDoneEvent;
  "session.done": SessionDoneEvent;
  "audio.cancelled": AudioCancelledEvent;
  error: ErrorEvent;
  "*": ServerEvent;
  audio: AudioPiece;
  close: CloseDetail;
  /** The socket dropped without a close frame; the client is reconnecting to resume the session. */
  reconnecting: { attempt: number; delayMs: number };
  /** Resumed on a new socket: the server replays the frames that were lost, then the stream goes on. */
  resumed: { replayFrames: number; replayBytes: number };
}

declare class Emitter<M> {
  /** Subscribe; returns the function that unsubscribes. */
  on<K extends keyof M>(type: K, handler: (detail: M[K]) => void): () => void;
  off<K extends keyof M>(type: K, handler: (detail: M[K]) => void): void;
}

export type VoicewireErrorKind = "unreachable" | "unauthorized" | "not_ready" | "refused" | "closed" | "server" | "state";

export declare class VoicewireError extends Error {
  readonly kind: VoicewireErrorKind;
  readonly detail: Record<string, unknown>;
  constructor(kind: VoicewireErrorKind, message: string, detail?: Record<string, unknown>);
}

/** The speech stream URL of the server that served the page. */
export declare function defaultUrl(): string;

export declare class VoicewireClient extends Emitter<ClientEventMap> {
  /** `resume` (default true): reconnect and resume by itself after a network blip. */
  constructor(options?: { url?: string; token?: string; resume?: boolean });
  readonly url: string;
  readonly token: string | null;
  readonly resume: boolean;
  /** Times the session resumed on a new socket. */
  readonly reconnects: number;
  /** A dropped socket is being resumed; messages sent meanwhile go out on the resumed socket. */
  readonly reconnecting: boolean;
  /** `url` with `?token=` when a token is set. */
  readonly socketUrl: string;
  readonly connected: boolean;
  /** The last accepted config's answer. */
  readonly updated: SessionUpdatedEvent | null;
  /** The utterance index the next sendText() (or done()) belongs to. */
  readonly currentUtteranceIndex: number;
  /** Resolves when open; rejects with a VoicewireError saying what to fix (unreachable, token, ...). */
  connect(): Promise<this>;
  /** Resolves with session.updated; rejects with the server's refusal (kind "server"). */
  configure(config?: SessionConfig): Promise<SessionUpdatedEvent>;
  sendText(text: string, contextId?: string): void;
  done(contextId?: string): void;
  /** Barge-in: no "audio" event of the cancelled utterances follows this call. */
  cancel(contextId?: string): void;
  isCancelled(utteranceIndex: number): boolean;
  close(): void;
}

/** Decodes one unit's audio, fed in pieces, to pcm16 samples. */
export declare class UnitDecoder {
  constructor(format: DecodableFormat);
  readonly format: DecodableFormat;
  feed(data: ArrayBuffer): Int16Array;
}

export interface PlayerCounters {
  /** Source samples sent to the speakers. */
  played: number;
  /** Source samples discarded by cancel(). */
  dropped: number;
  /** Source samples pushed. */
  received: number;
  /** Times playback ran dry before flush(). */
  underruns: number;
  buffered: number;
  playing: boolean;
}

export interface CancelledCounters extends PlayerCounters {
  /** Stream index where playback stopped: samples from here on were dropped, never heard. */
  at: number;
}

export interface PlayerEventMap {
  position: PlayerCounters;
  cancelled: PlayerCounters;
}

export declare class PcmPlayer extends Emitter<PlayerEventMap> {
  /** Create (or use) an AudioContext and load the worklet; call from a user gesture. */
  static create(options?: { context?: AudioContext; jitterMs?: number; workletUrl?: string | URL }): Promise<PcmPlayer>;
  readonly context: AudioContext;
  readonly node: AudioWorkletNode;
  readonly received: number;
  readonly played: number;
  readonly dropped: number;
  readonly underruns: number;
  readonly playing: boolean;
  /** The AudioContext's sample rate (audio is resampled to it). */
  readonly outputRate: number;
  /** Stream index of the next sample to play: played + dropped. */
  readonly position: number;
  resume(): Promise<void>;
  /** Queue samples; returns the stream index of the first of them. */
  push(samples: Int16Array | Float32Array, sampleRate: number): number;
  /** Play what is queued even below the jitter buffer; no underrun when it runs out. */
  flush(): void;
  /** Drop all queued audio at once; resolves when the worklet has, with where playback stopped. */
  cancel(): Promise<CancelledCounters>;
  setJitter(ms: number): void;
  close(): Promise<void>;
}

export interface WordEvent extends WordTiming {
  utteranceIndex: number;
  /** index of the word in the utterance */
  index: number;
  /** the player position (stream index) when the word was reached */
  played: number;
}

export interface UtteranceEvent {
  utteranceIndex: number;
  /** stream index of the utterance's first sample, null if it had no audio */
  start: number | null;
  samples: number;
  sampleRate: number;
}

export interface SpeakerEventMap {
  word: WordEvent;
  "utterance.start": UtteranceEvent;
  "utterance.end": UtteranceEvent;
  /** After cancel(): `played` counts the utterance's samples that were heard, not the dropped rest. */
  "utterance.cancelled": { utteranceIndex: number; played: number; sampleRate: number };
}

/** Client audio into the player; "word" when the played position reaches each word. */
export declare class Speaker extends Emitter<SpeakerEventMap> {
  constructor(client: VoicewireClient, player: PcmPlayer);
  readonly client: VoicewireClient;
  readonly player: PcmPlayer;
  /** Output latency subtracted from the played position before words are due. */
  readonly latencyMs: number;
  /** Barge-in: silence the player and cancel the server's utterances; resolves once it is silent. */
  cancel(): Promise<CancelledCounters>;
  detach(): void;
}
